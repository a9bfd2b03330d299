"""The one chat-turn road every chat route shares: the strict request decoder
(``decode``), the canonical turn (``canonical``), tool setup and tool-call
parsing (``tools``, ``tool_calls``, ``fenced_calls``, ``generic_tools``), the
reasoning split (``reasoning``), admission of one row per choice
(``choices``), output memory and cache-miss notes, and ``chat_turn``, which
submits a turn and streams or collects it. No module here imports an API
package (transport.openai, transport.anthropic, transport.responses)."""
