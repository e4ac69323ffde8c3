"""/p2pswarm/shard/1.0.0: shard serving and the resumable, checked download; a backbone's dense part."""
