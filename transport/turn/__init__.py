"""The one chat-turn road every chat route shares: the strict request decoder
(``decode``), the canonical turn (``canonical``), tool setup and tool-call
parsing (``tools``, ``tool_calls``, ``fenced_calls``, ``generic_tools``), the
reasoning split (``reasoning``), admission of one row per choice
(``choices``), output memory and cache-miss notes, ``chat_turn``, which
renders a prompt and streams or collects an answer, and ``road``: the one
pipeline (``run_turn``) every generation route runs, each route handing it
only its door (a ``ChatRoute``: parser and encoder). No module here imports an API
package (transport.openai, transport.anthropic, transport.responses)."""
