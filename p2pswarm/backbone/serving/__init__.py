"""Requests and the batch: one request's generation, the scheduler, the layer loop, drafts, sampling, the top-k combine, and the types a request crosses these layers in."""
