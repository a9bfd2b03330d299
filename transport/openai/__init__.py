"""The OpenAI API: the chat completions and completions routes (``api``),
request schema (``schema``), response bodies (``bodies``), the chat/completion
encoder (``render``), embeddings, and the gateway-compat aliases. The routes
are mounted by ``transport.server.http``."""
