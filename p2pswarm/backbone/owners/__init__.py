"""Where a layer's rows are computed: peers over libp2p, worker processes on a socket, the backbone's own experts (its expert cache, the in-process owners)."""
