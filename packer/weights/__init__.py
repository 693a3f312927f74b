"""Planning (names, aliases, shards) and the streaming safetensors writer."""
