"""Ember's transports: one folder per API over one shared chat-turn road.

- ``transport.cli``: the ``ember`` command.
- ``transport.server``: the shell; ``server.http`` builds the Starlette app and
  mounts the routes (plus security, connection guards, the UI, launch helpers).
- ``transport.openai``, ``transport.anthropic``, ``transport.responses``: one
  folder per API, each its schema (parser), bodies (encoder) and route code;
  none imports another.
- ``transport.turn``: the road every chat route shares: decode -> canonical
  turn -> render the prompt -> admit -> stream or collect -> finish.
- ``transport.wire``: what every route shares with its client (body reading,
  SSE, the error envelope, limits, metrics, API keys).

See docs/architecture.md and docs/http.md."""
