"""The pure room domain: state, commands, events and the decide/evolve pair. No I/O."""
