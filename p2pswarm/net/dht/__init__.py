"""The DHT: Kademlia look-ups, the provider side, the coverage resolver."""
