"""Consumer groups on the broker: the runtime every group uses (``runtime``) and one module per group."""
