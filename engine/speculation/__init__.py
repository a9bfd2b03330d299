"""Speculative decoding: the drafters' data structures, the γ policy and its costs."""

MODEL_FREE_DRAFTERS = ("ngram", "suffix")  # need no model: any target, any backend


def model_free(draft_model: str | None) -> bool:
    """Is ``draft_model`` a drafter that runs no model (prompt lookup, suffix
    decoding, with their options: ``ngram:2:4``, ``suffix+ngram``)?"""
    return bool(draft_model) and str(draft_model).startswith(MODEL_FREE_DRAFTERS)
