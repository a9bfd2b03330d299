"""A deterministic fake GPU that implements the same ``Backend`` port as MLX.

The next token is a pure function of the context tokens: each layer's cache
stores, per position, the token and a running hash of the whole prefix, and
the logits are drawn from a generator whose state is a hash of (model seed,
running hash at the last position). So any test knows the exact expected output
(``expected_tokens``) without running the engine, and a cache that was
restored, trimmed or reused wrongly yields different tokens.

Caches are real arrays with the shape and trim semantics of mlx-lm's
``KVCache`` (numpy, ``(1, heads, capacity, head_dim)``, capacity in steps of
256), so the cold tier persists and restores them like MLX caches.
Time is a cost model (prefill ``a + b·tokens``, decode ``c + d·rows``, verify
per window token) slept in virtual time by ``InlineDevice``; faults (slow
step, hung step, out-of-memory) are seeded knobs.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import math
import operator
import threading
from bisect import bisect_right
from typing import Any

import msgspec
import numpy as np

from engine.mlx.tokenizer import ToolMarkup
from engine.ports import ModelInfo, StepPlan, StepResult
from engine.types import GREEDY_TEMPERATURE, SamplingParams

HASH_MOD = 16_777_213  # prime below 2**24: a running hash stays exact in float32
HASH_MUL = 1_000_003


class FakeGPUConfig(msgspec.Struct, frozen=True, kw_only=True):
    seed: int = 0
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 4
    context_length: int = 32_768
    eos_bias: float = 0.0  # added to the EOS logit; >0 makes EOS appear
    # cost model, seconds
    prefill_a: float = 0.004
    prefill_b: float = 0.00005
    decode_c: float = 0.010
    decode_d: float = 0.0005
    verify_b: float = 0.0006
    # faults
    fault_seed: int = 0
    slow_step_prob: float = 0.0
    slow_step_factor: float = 20.0
    hang_step_prob: float = 0.0
    oom_step_prob: float = 0.0


# --------------------------------------------------------------------------
# Tokenizer: bytes are tokens 0..255, EOS is 256.


class ByteDetokenizer:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._segment = ""
        self._pending = False  # the decoder holds the first bytes of a sequence

    def add_token(self, token: int) -> None:
        if token < 128 and not self._pending:  # what the decoder gives an ASCII byte with nothing held
            self._segment = chr(token)
        elif not self._pending and (token < 0xC2 or 0xF5 <= token < 256):
            # a byte that cannot start a sequence (a lone continuation byte,
            # an overlong or out-of-range lead), with nothing held: the
            # decoder replaces it and still holds nothing
            self._segment = "\ufffd"
        elif token < 256:
            self._segment = self._dec.decode(bytes([token]))
            self._pending = bool(self._dec.getstate()[0])
        else:
            self._segment = ""

    def finalize(self) -> None:
        self._segment = self._dec.decode(b"", final=True)
        self._pending = False

    @property
    def last_segment(self) -> str:
        seg, self._segment = self._segment, ""
        return seg


def _parse_json_call(text: str, tools: Any = None) -> Any:
    """mlx-lm's `json_tools` parser, without importing mlx-lm."""
    return json.loads(text.strip())


class ByteTokenizer:
    EOS = 256
    vocab_size = 260

    def __init__(self) -> None:
        self.eos_token_ids = {self.EOS}
        self.tool_markup = ToolMarkup(start="<tool_call>", end="</tool_call>", parser=_parse_json_call, json_form=True)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools))

    def encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        text = f"<|tools|>{json.dumps(tools)}\n" if tools else ""
        for m in messages:
            text += f"<|{m['role']}|>{m.get('content') or ''}"
            for call in m.get("tool_calls") or []:  # the Hermes/Qwen form, like the bundled tiny template
                fn = call.get("function", call)
                args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args}}}\n</tool_call>'
            text += "\n"
        return text + "<|assistant|>"


# --------------------------------------------------------------------------
# Cache: numpy mirror of mlx_lm.models.cache.KVCache.


class FakeKVCache:
    step = 256

    def __init__(self) -> None:
        # np.ndarray after the first update, None before: typed Any because the
        # per-token paths index them unguarded once a layer is known to hold rows
        self.keys: Any = None
        self.values: Any = None
        self.offset = 0

    def update(self, keys: np.ndarray, values: np.ndarray) -> None:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            steps = (self.step + n - 1) // self.step
            shape_k = (1, keys.shape[1], steps * self.step, keys.shape[3])
            shape_v = (1, values.shape[1], steps * self.step, values.shape[3])
            new_k = np.zeros(shape_k, keys.dtype)
            new_v = np.zeros(shape_v, values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = np.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = np.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes in use (tokens up to ``offset``), not the step-padded capacity."""
        if self.keys is None:
            return 0
        per_token = self.keys[..., :1, :].nbytes + self.values[..., :1, :].nbytes
        return per_token * self.offset

    def copy(self) -> FakeKVCache:
        c = FakeKVCache()
        if self.keys is not None:
            c.keys = self.keys[..., : self.offset, :].copy()
            c.values = self.values[..., : self.offset, :].copy()
        c.offset = self.offset
        return c


# --------------------------------------------------------------------------
# The deterministic "model".


def _initial_hash(seed: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"ember-fake-{seed}".encode(), digest_size=4).digest()) % HASH_MOD


def _advance(h: int, token: int) -> int:
    return (h * HASH_MUL + token + 1) % HASH_MOD


_POW = np.ones(1, np.int64)  # HASH_MUL**k % HASH_MOD for k = 0..len-1, grown on demand
_IPOW = np.ones(1, np.int64)  # the inverse powers (HASH_MOD is prime)


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    global _POW, _IPOW
    if _POW.size <= n:
        size = max(n + 1, 2 * _POW.size, 1024)
        inv = pow(HASH_MUL, -1, HASH_MOD)
        pw, ipw = [1] * size, [1] * size
        for k in range(1, size):
            pw[k] = pw[k - 1] * HASH_MUL % HASH_MOD
            ipw[k] = ipw[k - 1] * inv % HASH_MOD
        _POW, _IPOW = np.array(pw, np.int64), np.array(ipw, np.int64)
    return _POW, _IPOW


def running_hashes(h: int, tokens: Any) -> np.ndarray:
    """The running hash after each of ``tokens`` from ``h`` (int64), what
    ``_advance`` gives one token at a time, in a few vectorized steps:
    h_i = M^i (h + sum_{j<=i} (t_j + 1) M^-j) mod P. Every product stays
    below 2^49, so int64 is exact."""
    t = np.asarray(tokens, np.int64)
    n = t.size
    if n <= 16:  # a Python loop is cheaper than the numpy calls
        out = np.empty(n, np.int64)
        for i, tok in enumerate(t.tolist()):
            h = _advance(h, tok)
            out[i] = h
        return out
    pw, ipw = _power_tables(n)
    c = (t + 1) * ipw[1 : n + 1] % HASH_MOD
    acc = (np.cumsum(c) + h) % HASH_MOD
    return pw[1 : n + 1] * acc % HASH_MOD


def advance_all(h: int, tokens: Any) -> int:
    """The running hash after all of ``tokens`` from ``h``."""
    if len(tokens) <= 16:
        for tok in tokens:
            h = _advance(h, int(tok))
        return h
    return int(running_hashes(h, tokens)[-1])


_tls = threading.local()


def _generator_at(seed: int, h: int) -> np.random.Generator:
    """This thread's PCG64, set to a state drawn from blake2b(seed, h).

    ``PCG64([seed, h])`` spends ~15 us in SeedSequence per token, most of
    the fake GPU's cost; setting the state of one reused generator from a
    256-bit hash (128-bit state, odd 128-bit increment: an independent-looking
    stream per context) costs a few. Per thread: a backend may step off the
    event loop. Where this numpy's PCG64 state has the layout
    ``_raw_state_setter`` checks, the digest's bytes are written into it
    directly (the ``state`` property's dict parsing was a third of a draw)."""
    gs = getattr(_tls, "gen", None)
    if gs is None:
        g = np.random.Generator(np.random.PCG64(0))
        gs = _tls.gen = (g, _raw_state_setter(g))
    g, raw = gs
    d = hashlib.blake2b(b"%d:%d" % (seed, h), digest_size=32).digest()
    if raw is not None:
        raw(d)
        return g
    x = int.from_bytes(d, "little")
    g.bit_generator.state = _state_dict(x)
    return g


def _state_dict(x: int) -> dict[str, Any]:
    return {
        "bit_generator": "PCG64",
        # the digest's first 16 bytes (little endian) and its last 16, made odd
        "state": {"state": x & _MASK128, "inc": (x >> 128) | 1},
        "has_uint32": 0,
        "uinteger": 0,
    }


def _raw_state_setter(g: np.random.Generator) -> Any:
    """A function that sets ``g``'s PCG64 to ``_state_dict`` of a 32-byte
    digest by writing the bytes in place: numpy's ``pcg64_state`` (a pointer
    to the 128-bit state and increment, then ``has_uint32`` and ``uinteger``)
    with native 128-bit integers on a little-endian 64-bit machine, where the
    state's 16 bytes are the digest's first 16 and the increment's its last
    16 with the low bit set. None unless setting a few digests this way gives
    exactly the state (and the draws) the ``state`` property gives."""
    try:
        import ctypes
        import sys

        if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
            return None
        addr = g.bit_generator.ctypes.state_address
        inner_addr = ctypes.c_void_p.from_address(addr).value
        if not inner_addr:
            return None
        inner = memoryview((ctypes.c_uint8 * 32).from_address(inner_addr)).cast("B")
        flags = memoryview((ctypes.c_uint8 * 8).from_address(addr + 8)).cast("B")
        zero8 = bytes(8)

        def raw(d: bytes) -> None:
            inner[:] = d
            inner[16] |= 1
            flags[:] = zero8

        ref = np.random.Generator(np.random.PCG64(0))
        for i in range(4):
            d = hashlib.blake2b(b"check:%d" % i, digest_size=32).digest()
            g.standard_normal(3, dtype=np.float32)  # leaves a buffered uint32 behind
            raw(d)
            ref.bit_generator.state = _state_dict(int.from_bytes(d, "little"))
            if g.bit_generator.state != ref.bit_generator.state:
                return None
            if not np.array_equal(g.standard_normal(9, dtype=np.float32), ref.standard_normal(9, dtype=np.float32)):
                return None
        return raw
    except Exception:  # noqa: BLE001 - any surprise: the ``state`` property
        return None


_MASK128 = (1 << 128) - 1


@functools.lru_cache(maxsize=8192)
def fake_logits(seed: int, h: int, vocab: int, eos_bias: float = 0.0) -> np.ndarray:
    """Logits after a context whose running hash is ``h`` (read-only).

    Memoized: drawing them is most of the fake GPU's cost, and the same
    contexts recur (the oracle re-deriving a request's tokens, the fake
    drafter, shared prefixes)."""
    logits = _draw_logits(seed, h, vocab, eos_bias)
    logits.flags.writeable = False
    return logits


def _draw_logits(seed: int, h: int, vocab: int, eos_bias: float) -> np.ndarray:
    """``fake_logits`` unmemoized (a fresh writable array)."""
    logits = _generator_at(seed, h).standard_normal(vocab, dtype=np.float32)
    logits *= 3.0
    logits += _logit_offsets(vocab, eos_bias)
    return logits


_OFFSETS: dict[tuple[int, float], np.ndarray] = {}


def _logit_offsets(vocab: int, eos_bias: float) -> np.ndarray:
    """What is added to the scaled draws, as one float32 vector: ``eos_bias -
    4.0`` at EOS (a float32 element plus a Python float is a float32 add of
    the float rounded to float32, which is what this vector holds), ``-inf``
    at the spare ids (a finite draw plus -inf is -inf), 0 elsewhere. One
    ufunc call instead of an indexed add and a slice assignment per draw."""
    off = _OFFSETS.get((vocab, eos_bias))
    if off is None:
        off = np.zeros(vocab, np.float32)
        off[ByteTokenizer.EOS] = eos_bias - 4.0
        off[ByteTokenizer.EOS + 1 :] = -np.inf  # spare ids never appear
        off.flags.writeable = False
        _OFFSETS[(vocab, eos_bias)] = off
    return off


@functools.lru_cache(maxsize=8192)
def greedy_token(seed: int, h: int, vocab: int, eos_bias: float = 0.0) -> int:
    """The greedy next token after a context whose running hash is ``h``:
    ``fake_logits(...).argmax()``, memoized like the logits (the simulator's
    oracle re-derives every greedy token the engine sampled). The logits are
    drawn without going through ``fake_logits``' memo: nothing reads a greedy
    row's logits again, and holding 8192 of them (8 MB) made every draw write
    a fresh, cache-cold array; freed at once, the next draw reuses the same
    memory (a greedy token in a chat-10k run 12 -> 8.6 us). The one reader
    that could have shared them, the fake drafter's proposal for the same
    context, then costs a second draw of the same values."""
    return int(_draw_logits(seed, h, vocab, eos_bias).argmax())


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
    instead of sorting all 260 ids: a miss 14.5 -> ~9 us."""
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


def expected_tokens(
    prompt: list[int],
    n: int,
    cfg: FakeGPUConfig = FakeGPUConfig(),
    *,
    stop_at_eos: bool = True,
) -> list[int]:
    """The reference greedy continuation, computed without any cache."""
    h = advance_all(_initial_hash(cfg.seed), prompt)
    out: list[int] = []
    for _ in range(n):
        tok = int(fake_logits(cfg.seed, h, ByteTokenizer.vocab_size, cfg.eos_bias).argmax())
        out.append(tok)
        if stop_at_eos and tok == ByteTokenizer.EOS:
            break
        h = _advance(h, tok)
    return out


class _Row:
    __slots__ = ("cache", "sampling", "seed", "_rng")

    def __init__(self, cache: list[FakeKVCache], sampling: SamplingParams, seed: int):
        self.cache = cache
        self.sampling = sampling
        self.seed = seed
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        """The row's sampler, made at its first draw: a greedy row never draws,
        and a ``PCG64(seed)`` (its SeedSequence) costs ~20 us per request."""
        if self._rng is None:
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
        return self._rng


class FakeBackend:
    """Implements ``engine.ports.Backend`` on numpy."""

    def __init__(self, cfg: FakeGPUConfig = FakeGPUConfig()):
        self.cfg = cfg
        self.tokenizer = ByteTokenizer()
        # The model's identity only: the cost model and fault knobs change how a
        # step behaves, not what it computes, so a restart with other fault
        # settings (a simulation's next run) still finds its own SSD entries.
        model = (cfg.seed, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.context_length, cfg.eos_bias)
        fp = hashlib.blake2b(msgspec.json.encode(model), digest_size=8).hexdigest()
        self.info = ModelInfo(
            model_id=f"fake-gpu-{cfg.seed}",
            vocab_size=ByteTokenizer.vocab_size,
            context_length=cfg.context_length,
            config_fingerprint=fp,
            tokenizer_hash="bytes-v1",
            num_layers=cfg.num_layers,
        )
        self._h0 = _initial_hash(cfg.seed)
        self._row_shape = (cfg.head_dim,)
        # one decode position's key and value rows, reused: only [0] and [1] are
        # ever set, the rest stay zero (the rows are copied into the caches)
        self._row_k = np.zeros(self._row_shape, np.float32)
        self._row_v = np.zeros(self._row_shape, np.float32)
        self._rows: dict[int, _Row] = {}
        self._fault_rng = np.random.Generator(np.random.PCG64(cfg.fault_seed))
        self.steps = 0

    # ---- caches --------------------------------------------------------
    def make_cache(self) -> list[FakeKVCache]:
        return [FakeKVCache() for _ in range(self.cfg.num_layers)]

    def cache_nbytes(self, cache: list[FakeKVCache]) -> int:
        return sum(c.nbytes for c in cache)

    def prefix_view(self, cache: list[FakeKVCache], n: int) -> list[FakeKVCache]:
        """A private copy of the first ``n`` positions (the MLX backend's is lazy)."""
        out = [c.copy() for c in cache]
        excess = min((c.offset for c in out), default=n) - n
        if excess < 0 or (excess and self.trim_cache(out, excess) != excess):
            raise ValueError(f"the cache cannot serve {n} tokens")
        return out

    def trim_cache(self, cache: list[FakeKVCache], n: int) -> int:
        return min(c.trim(n) for c in cache) if cache else 0

    def cache_trimmable(self, cache: list[FakeKVCache]) -> bool:
        return all(c.is_trimmable() for c in cache)

    def _feed(self, cache: list[FakeKVCache], tokens: list[int]) -> int:
        """Append tokens to every layer; return the running hash after them."""
        n = len(tokens)
        if n == 1:
            h = self._feed_one(cache, tokens[0])
            if h is not None:
                return h
        last = cache[-1]
        if last.offset:
            h = int(last.values[0, 0, last.offset - 1, 0])
        else:
            h = self._h0
        H, D = self.cfg.num_kv_heads, self.cfg.head_dim
        # the tokens as an array once (for the hashes and the cache rows; ids
        # below 2**24 are exact in float32 from int64 as from a Python int)
        toks = np.fromiter(tokens, np.int64, n) if isinstance(tokens, list) else np.asarray(tokens, np.int64)
        hashes = running_hashes(h, toks)
        h = int(hashes[-1]) if n else h
        pos = np.arange(last.offset, last.offset + n, dtype=np.float32)
        keys = np.zeros((1, H, n, D), np.float32)
        keys[..., 0] = toks
        keys[..., 1] = pos
        values = np.zeros((1, H, n, D), np.float32)
        values[..., 0] = hashes
        values[..., 1] = toks
        for c in cache:
            c.update(keys, values)
        return h

    def _feed_one(self, cache: list[FakeKVCache], t: int) -> int | None:
        """A decode step's one token written in place (no temporaries) when
        every layer has room for it; returns the running hash after it, or
        None (nothing written) when a layer must grow: ``_feed`` then."""
        for c in cache:
            if c.keys is None or c.offset >= c.keys.shape[2]:
                return None
        last = cache[-1]
        off = last.offset
        # the hash is stored as a float32 holding an integer below 2**24 (exact)
        h = _advance(int(last.values.item(0, 0, off - 1, 0)) if off else self._h0, t)
        k, v = self._row_k, self._row_v  # one position, every head (broadcast)
        k[0], k[1], v[0], v[1] = t, off, h, t
        for c in cache:
            o = c.offset
            c.keys[0, :, o] = k
            c.values[0, :, o] = v
            c.offset = o + 1
        return h

    def _next(self, row: _Row, h: int) -> int:
        sp = row.sampling
        if sp.temperature < GREEDY_TEMPERATURE:  # greedy (``sample_token``'s first case): the sampler is not needed
            return greedy_token(self.cfg.seed, h, ByteTokenizer.vocab_size, self.cfg.eos_bias)
        logits = fake_logits(self.cfg.seed, h, ByteTokenizer.vocab_size, self.cfg.eos_bias)
        return sample_token(logits, sp, row.rng)

    # ---- the port --------------------------------------------------------
    def step_cost_s(self, plan: StepPlan) -> float:
        cfg = self.cfg
        cost = 0.0
        if plan.prefill:
            cost += cfg.prefill_a + cfg.prefill_b * sum(len(c.tokens) for c in plan.prefill)
        if plan.decode or plan.verify:  # decode and verify rows share one batched forward
            cost += cfg.decode_c + cfg.decode_d * len(plan.decode)
            cost += cfg.verify_b * sum(len(v.tokens) for v in plan.verify)
        if cost and cfg.slow_step_prob and self._fault_rng.random() < cfg.slow_step_prob:
            cost *= cfg.slow_step_factor
        if cost and cfg.hang_step_prob and self._fault_rng.random() < cfg.hang_step_prob:
            cost = math.inf
        return cost

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        res = StepResult()
        for rid in plan.close:
            row = self._rows.pop(rid, None)
            if row is not None and rid in plan.keep_cache:
                res.closed[rid] = row.cache
        for o in plan.open:
            seed = o.sampling.seed if o.sampling.seed is not None else (self.cfg.seed << 20) + o.rid
            cache = o.cache if o.cache is not None else self.make_cache()
            self._rows[o.rid] = _Row(cache, o.sampling, seed)
        for rid, n in plan.trim:
            self.trim_cache(self._rows[rid].cache, n)
        busy = plan.prefill or plan.decode or plan.verify
        if self.cfg.oom_step_prob and busy and self._fault_rng.random() < self.cfg.oom_step_prob:
            raise MemoryError("fake GPU: out of memory")
        for c in plan.prefill:
            self._feed(self._rows[c.rid].cache, c.tokens)
        rows, feed = self._rows, self._feed_one
        for d in plan.decode:
            row = rows[d.rid]
            h = feed(row.cache, d.token)
            if h is None:  # a layer grows
                h = self._feed(row.cache, [d.token])
            res.tokens[d.rid] = self._next(row, h)
        for v in plan.verify:
            row = self._rows[v.rid]
            # A window is only fed where it can be trimmed back; otherwise decode
            # just `last` and answer one token (the Verifier falls back).
            window = v.tokens if self.cache_trimmable(row.cache) else v.tokens[:1]
            out = []
            for t in window:
                out.append(self._next(row, self._feed(row.cache, [t])))
            res.verified[v.rid] = out
        return res

    def row_cache(self, rid: int) -> list[FakeKVCache]:
        return self._rows[rid].cache
