"""py-libp2p: the host, its streams and addresses, the relay client, and every patch to the library."""
