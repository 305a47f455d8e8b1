"""Read models kept beside the authority: the room list and presence. Best effort by design."""
