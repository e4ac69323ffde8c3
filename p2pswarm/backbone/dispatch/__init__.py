"""A layer's plan run: the dispatcher (fallback), routing and back-off, sampled verification and taint, counters and demand."""
