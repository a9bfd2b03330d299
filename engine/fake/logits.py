"""The fake GPU's deterministic "model": the next token's logits are a pure
function of the context, drawn from a generator whose state is a hash of
(model seed, running hash of every token so far)."""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Any

import numpy as np

from engine.fake.tokenizer import ByteTokenizer

HASH_MOD = 16_777_213  # prime below 2**24: a running hash stays exact in float32
HASH_MUL = 1_000_003


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
    memory (measured: docs/sims.md, Speed). The one reader
    that could have shared them, the fake drafter's proposal for the same
    context, then costs a second draw of the same values."""
    return int(_draw_logits(seed, h, vocab, eos_bias).argmax())
