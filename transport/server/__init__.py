"""The server shell: ``http`` builds the Starlette app and mounts every API's
routes (transport.openai, transport.anthropic, transport.responses) and the UI
(``ui_routes``); ``security`` and ``conn_guard`` guard it; ``launch`` and
``model_cmds`` are the ``ember`` command's helpers (transport.cli)."""
