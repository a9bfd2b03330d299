"""One set of request limits and defaults (numbers only: this module imports
nothing, so ``engine.types`` takes ``DEFAULT_MAX_TOKENS`` from it and the one
check of a request's parameters, ``engine.request_check``, sits above both).

Logits-processing ranges are OpenAI's: penalties in [-2, 2], ``logit_bias``
values in [-100, 100], at most 20 top logprobs.
"""

from __future__ import annotations

# When a request sets no max_tokens (mlx_lm.server's default); HTTP clamps it
# to the context left after the prompt.
DEFAULT_MAX_TOKENS = 512
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the stop matcher holds back up to len(stop)-1 chars and rescans them per token
# A draft window is verified in one forward; a fixed γ beyond this is only waste
# (engine.speculation.policy, EngineConfig.num_draft_tokens, a request's num_draft_tokens).
MAX_DRAFT_TOKENS = 16
MAX_CHOICES = 16  # OpenAI's ``n``: each choice is a row of the batch
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
