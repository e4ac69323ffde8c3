"""What peers sign and check: a node's key, signed envelopes, node records, capability tokens."""
