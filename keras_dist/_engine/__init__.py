"""The replica engines: compiled (``jax.jit`` over ``jax.shard_map``) and eager (threads)."""
