"""The towerd daemon: the one process that owns the fleet's state."""
