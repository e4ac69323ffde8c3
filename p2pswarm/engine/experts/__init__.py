"""The expert banks (contracts.ExpertBank), one per kernel: numpy, ggml, portable; and what one expert computes."""
