"""relay-443: the circuit relay v2 service NATed workers reach over WebSocket (see relay.service),
and the client side that keeps a worker's reservation (relay.client)."""
