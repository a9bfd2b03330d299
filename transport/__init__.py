"""Ember's transports: the OpenAI-compatible HTTP server (``transport.http``,
Starlette on uvicorn) and the ``ember`` command (``transport.cli``).
See docs/http.md."""
