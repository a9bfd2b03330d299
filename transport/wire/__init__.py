"""What every route shares to talk to its client, below the chat-turn road:
reading a body and answering (``request_io``), server-sent events (``sse``),
the error envelope (``errors``), output limits (``limits``), metrics and the
UI's stats (``metrics``, ``ui_stats``, ``envelope``), and API keys
(``api_keys``). Nothing here imports a route or the road."""
