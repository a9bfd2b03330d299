"""The fake GPU's sampler: temperature, top-k, top-p and min-p over the fake
logits, drawing from each row's own generator (no MLX)."""

from __future__ import annotations

import operator
from bisect import bisect_right

import numpy as np

from engine.types import GREEDY_TEMPERATURE, SamplingParams

# (logits, temperature, top_p) -> the kept ids and their cdf (Python lists), by
# the identity of a read-only logits array (held in the entry, so its id cannot be reused)
_NUCLEI: dict[int, tuple[np.ndarray, float, float, list[int], list[float], float]] = {}
_NUCLEI_MAX = 2048


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    # in place where it can be, the same values as the plain expressions
    # (the ufunc reductions ``z.max()``/``p.sum()`` call, without their Python wrappers)
    z = logits.astype(np.float64)
    z /= temperature
    z -= _max(z)
    p = np.exp(z, out=z)
    p /= _sum(p)
    return p


_max, _sum = np.maximum.reduce, np.add.reduce


def _cut(p: np.ndarray, order: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray, int]:
    cdf = p[order].cumsum()
    return order, cdf, (min(int(cdf.searchsorted(top_p)) + 1, p.size) if top_p < 1.0 else p.size)


def _nucleus(logits: np.ndarray, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The ids kept by temperature + top-p in descending probability, their
    cumulative probabilities and the total (``_nucleus_lists`` as arrays)."""
    kept, cdf, total = _nucleus_lists(logits, temperature, top_p)
    return np.array(kept, np.intp), np.array(cdf, np.float64), total


def _nucleus_lists(logits: np.ndarray, temperature: float, top_p: float) -> tuple[list[int], list[float], float]:
    """The nucleus as Python lists: ``sample_token`` draws from ~11 kept ids
    with a bisect, cheaper than numpy calls on arrays that small. Memoized
    for the read-only arrays of ``fake_logits``: a sampled token is derived
    twice from the same logits and parameters (the engine, then the
    simulator's oracle)."""
    hit = _NUCLEI.get(id(logits))
    if hit is not None and hit[0] is logits and hit[1] == temperature and hit[2] == top_p:
        return hit[3], hit[4], hit[5]
    p = _softmax(logits, temperature)
    found = _top_nucleus(p, top_p) if top_p < 1.0 else None
    if found is None:
        kept, cdf, total = _full_nucleus(p, top_p)
        found = kept.tolist(), cdf.tolist(), total
    if not logits.flags.writeable:
        if len(_NUCLEI) >= _NUCLEI_MAX:
            del _NUCLEI[next(iter(_NUCLEI))]
        _NUCLEI[id(logits)] = (logits, temperature, top_p, *found)
    return found


# A nucleus is looked for first among the ids within this factor of the most
# likely one's probability (for the fake logits at T=0.7, top-p 0.95: ~16
# candidates for ~11 kept ids; 99% of nuclei lie inside)
_NUCLEUS_FLOOR = 0.005
_first = operator.itemgetter(0)


def _top_nucleus(p: np.ndarray, top_p: float) -> tuple[list[int], list[float], float] | None:
    """The nucleus (what ``_full_nucleus`` returns) when it lies among the
    candidates ``p >= floor``, else None. The candidates are every id above
    a probability, so every id outside is less likely than every one inside:
    sorted stably by descending probability (ties in id order: ``nonzero``
    gives ascending ids, and a reversed Python sort keeps equal items in
    their order) they are exactly the first entries of the stable sort of
    all ids. The running sum is the same sequential float64 sum as numpy's
    ``cumsum``, and the first index where it reaches ``top_p`` is
    ``searchsorted``'s on that non-decreasing cdf: when it reaches ``top_p``
    inside the candidates, the cut, the kept ids and their cdf are the full
    stable sort's, which ``_full_nucleus`` equals. ~16 candidates in Python
    instead of sorting all 260 ids (measured: docs/sims.md, Speed)."""
    cand = (p >= _max(p) * _NUCLEUS_FLOOR).nonzero()[0]
    kept: list[int] = []
    cdf: list[float] = []
    acc = 0.0
    for v, i in sorted(zip(p[cand].tolist(), cand.tolist()), key=_first, reverse=True):
        acc += v
        kept.append(i)
        cdf.append(acc)
        if acc >= top_p:
            return kept, cdf, acc
    return None


def _full_nucleus(p: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The nucleus by sorting every id."""
    # one sort serves both the nucleus cut and the draw, which runs over the
    # kept ids in descending probability (the same distribution as a draw in id order);
    # array methods, not the np.* wrappers around them (the same calls, less overhead)
    neg = -p
    order, cdf, cut = _cut(p, neg.argsort(), top_p)  # introsort: ~3x faster than the stable sort
    head = neg[order[: cut + 1]]
    if cut >= p.size or not (head[:-1] < head[1:]).all():
        # Two of the kept values tie (or the last kept ties the first dropped):
        # only there can the orders differ, and the stable sort decides. With
        # every kept value strictly above the next, both sorts put the same ids
        # first, so the cut, the kept ids and their cdf are the stable sort's.
        order, cdf, cut = _cut(p, neg.argsort(kind="stable"), top_p)
    return order[:cut].copy(), cdf[:cut].copy(), float(cdf[cut - 1])


def sample_token(logits: np.ndarray, sp: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else temperature, top-k, top-p, min-p, then a draw."""
    if sp.temperature < GREEDY_TEMPERATURE:
        return int(logits.argmax())
    if not (sp.top_k and sp.top_k > 0) and not sp.min_p > 0:
        # temperature and top-p only (the common case)
        kept, cdf, total = _nucleus_lists(logits, sp.temperature, sp.top_p)
        i = bisect_right(cdf, rng.random() * total)  # ``searchsorted(side="right")`` on the list
        return kept[min(i, len(kept) - 1)]  # min: a draw that rounds up to the total
    p = _softmax(logits, sp.temperature)
    keep: np.ndarray | None = None
    if sp.top_k and sp.top_k > 0:
        kth = np.sort(p)[-min(sp.top_k, p.size)]
        keep = p >= kth
    if sp.top_p < 1.0:
        order = np.argsort(-p)
        csum = np.cumsum(p[order])
        cut = np.searchsorted(csum, sp.top_p) + 1
        mask = np.zeros(p.size, dtype=bool)
        mask[order[:cut]] = True
        keep = mask if keep is None else keep & mask
    if sp.min_p > 0:
        floor = p >= sp.min_p * p.max()
        keep = floor if keep is None else keep & floor
    if keep is not None:
        p[~keep] = 0.0
    p /= p.sum()
    # ``rng.choice(p.size, p=p)`` without its argument checks (a third of a
    # sampled token's cost): the same cumsum, normalization, one ``random()``
    # draw and right-searchsorted, so the same token from the same stream.
    cum = p.cumsum()
    cum /= cum[-1]
    return int(cum.searchsorted(rng.random(), side="right"))
