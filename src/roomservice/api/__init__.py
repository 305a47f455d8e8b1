"""The gateway-facing HTTP API (SPEC §8)."""
