"""What runs in a ps or worker task: the server, the variable store, the worker service."""
