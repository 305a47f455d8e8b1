"""Room Cells: one actor per active room, their registry, and the lease port with fencing."""
