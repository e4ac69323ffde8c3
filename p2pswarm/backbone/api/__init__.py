"""The HTTP surface (docs/api.md): routes and response shapes, the OpenAI parameters and text loop, chat templates, stops, errors, /metrics, the status page."""
