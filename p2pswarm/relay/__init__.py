"""relay-443: the circuit relay v2 service NATed workers reach over WebSocket (:mod:`.service`), its
settings (:mod:`.config`: the TOML file) and its Prometheus metrics (:mod:`.metrics`).

The client side, which every node may need (a worker's reservation keeper, relay discovery, the
token protocol), lives in the network layer (:mod:`p2pswarm.net.libp2p.relay_client`,
:mod:`p2pswarm.net.libp2p.relay_discovery`, :mod:`p2pswarm.net.libp2p.relay_token`); nothing imports this
package but the ``relay`` command. Deploying it: relay/README.md and docs/deploy.md.
"""
