"""Variables on the parameter servers: ``PSVariable``, ``ShardedVariable``, partitioners, client.

``_trace``: what they see while the coordinator traces a scheduled function.
"""
