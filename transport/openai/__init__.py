"""The OpenAI API: request schema (``schema``: chat completions and
completions), response bodies (``bodies``), the chat/completion encoder
(``render``), embeddings, and the gateway-compat aliases. The routes are mounted
by ``transport.server.http``."""
