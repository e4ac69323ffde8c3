"""A backbone assembled: on local worker processes, or on the swarm (DHT, market, the expert cache's filler, refusal notices)."""
