"""The Anthropic Messages API: ``schema`` parses a request into the canonical
turn; ``api`` runs it on the shared road (``transport.turn``) and encodes the
Messages reply and its SSE events."""
