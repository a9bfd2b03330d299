"""The OpenAI Responses API: ``schema`` parses a request into the canonical
turn; ``api`` runs it on the shared road (``transport.turn``) and encodes the
response and its events; ``store`` keeps past responses for
``previous_response_id``."""
