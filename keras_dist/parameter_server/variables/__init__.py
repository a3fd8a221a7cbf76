"""Variables on the parameter servers: ``PSVariable``, ``ShardedVariable``, partitioners, client."""
