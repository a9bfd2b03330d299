"""Build speculative decoding from ``EngineConfig.draft_model`` (off when None):
``build_speculation``, called only by ``ember.assemble``.

``draft_model`` names the drafter:

* ``"ngram"`` — prompt lookup, any backend (``"ngram:MIN:MAX"`` sets the
  shortest and longest match tried, default 2 and 4);
* ``"suffix"`` — suffix decoding over the request's own text and every
  earlier prompt and response of its cache namespace, any backend;
  ``"suffix+ngram"`` composes it with prompt lookup (the better proposal
  wins each round; ``actors.suffix_cores``); ``"suffix:cut"`` cuts a lone
  row's draft to the length its measured cost and calibrated acceptance pay
  best (measured even with the default's on the 1.5B and SmolLM2, so an
  option: docs/speculation.md, "Draft length against cost");
* ``"tiny-draft"`` or a directory — an mlx-lm draft model (``backend="mlx"``),
  loaded on the engine's MLX thread from its own directory; it must share the
  target's tokenizer and must not be the target itself;
* ``"fake-draft"`` or ``"fake-draft:0.8"`` — the fake GPU's drafter
  (``backend="fake"``), agreeing with the target's greedy token with the given
  probability (default 0.7).

``num_draft_tokens`` fixes γ; None makes it adaptive (``engine.speculation.policy``).
A request's ``speculate=False`` or ``num_draft_tokens=0`` turns it off for that
request; asking for speculation from an engine without a drafter is an error,
never silently ignored (``check_request``).
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass
from typing import Any

from actors.drafter import Drafter
from actors.drafter_cores import DrafterCore, ModelDrafterCore, NgramDrafterCore
from actors.spec_rounds import SpecRounds
from actors.suffix_cores import REACH, SuffixDrafterCore
from actors.verifier import Verifier, VerifierCore
from engine.errors import InvalidRequest
from engine.speculation.policy import ACCEPT_PRIOR, WATCH_MATCH, GammaPolicy
from engine.types import SamplingParams

log = logging.getLogger("ember.speculation")


@dataclass(slots=True)
class Speculation:
    rounds: SpecRounds
    drafter: Drafter
    verifier: Verifier
    name: str

    def stats(self) -> dict[str, Any]:
        core = self.drafter.core
        extra: dict[str, Any] = {"draft_cache_rebuilds": core.rebuilds} if isinstance(core, ModelDrafterCore) else {}
        if isinstance(core, NgramDrafterCore | SuffixDrafterCore):
            gated = core.gated + (core.ngram.gated if isinstance(core, SuffixDrafterCore) and core.ngram else 0)
            extra["gated_proposals"] = gated  # withheld until a request's own draft is accepted
            extra["quorum_steps_dropped"] = self.rounds.quorum_dropped  # steps whose drafts fell short of their quorum
        if isinstance(core, SuffixDrafterCore):
            extra.update(core.stats())
        return {
            "drafter": self.name,
            "kind": core.kind,
            "draft_faults": self.drafter.faults,
            **extra,
            **self.verifier.core.stats(),
        }


def check_request(params: SamplingParams, spec: Speculation | None) -> None:
    """Refuse speculation settings this engine cannot honour (the ranges are
    checked with every other parameter, by ``engine.request_check.check_limits``)."""
    n = params.num_draft_tokens
    if spec is None and (params.speculate or (n is not None and n > 0)):
        raise InvalidRequest(
            "speculative decoding was asked for, but this engine has no drafter "
            "(start it with draft_model='ngram', 'tiny-draft' or a model path)",
            "speculate" if params.speculate else "num_draft_tokens",
        )
    if params.speculate and n == 0:
        raise InvalidRequest("speculate=true with num_draft_tokens=0 contradicts itself", "num_draft_tokens")
    if params.logprobs is not None and (params.speculate or (n is not None and n > 0)):
        raise InvalidRequest(
            "logprobs are computed on plain decode steps: a request asking for them does not speculate",
            "speculate" if params.speculate else "num_draft_tokens",
        )


def _ngram_core(name: str) -> DrafterCore:
    parts = name.split(":")[1:]
    try:
        sizes = [int(p) for p in parts]
        if len(sizes) > 2:
            raise ValueError
        return NgramDrafterCore(**dict(zip(("min_n", "max_n"), sizes)))
    except ValueError:
        raise InvalidRequest(f"bad n-gram drafter {name!r}: use ngram or ngram:MIN:MAX", "draft_model") from None


def _suffix_core(name: str) -> DrafterCore:
    if name == "suffix":
        return SuffixDrafterCore()
    if name == "suffix+ngram":
        return SuffixDrafterCore(ngram=NgramDrafterCore())
    if name == "suffix:cut":
        return SuffixDrafterCore(priced=True)
    raise InvalidRequest(f"bad suffix drafter {name!r}: use suffix, suffix+ngram or suffix:cut", "draft_model")


def _fake_core(name: str, fake_cfg: Any) -> DrafterCore:
    from engine.fake.draft_model import FakeDraftModel

    _, _, agree = name.partition(":")
    try:
        p = float(agree) if agree else 0.7
    except ValueError:
        raise InvalidRequest(f"bad fake drafter {name!r}: use fake-draft or fake-draft:0.8", "draft_model") from None
    model = FakeDraftModel(fake_cfg, agree=p, token_cost_s=fake_cfg.draft_token_s, feed_cost_s=fake_cfg.draft_feed_s)
    return ModelDrafterCore(model, name=name)


def _vocab(tok: Any) -> dict[str, int] | None:
    inner = getattr(tok, "_tok", tok)  # engine.mlx.tokenizer.MLXTokenizer wraps mlx-lm's wrapper
    for t in (inner, getattr(inner, "_tokenizer", None), getattr(inner, "tokenizer", None)):
        if t is not None and hasattr(t, "get_vocab"):
            return t.get_vocab()
    return None


def _same_tokenizer(target: Any, draft: Any) -> bool:
    a, b = _vocab(target), _vocab(draft)
    return a is not None and a == b


def _shares_tokenizer(target_tok: Any, model: Any) -> bool:
    """The drafter's own tokenizer equals the target's, or (shipped without
    one) the vocabulary digest in its config.json matches the target's."""
    if model.tokenizer is not None:
        return _same_tokenizer(target_tok, model.tokenizer)
    from engine.speculation.draft_model import vocab_digest

    vocab = _vocab(target_tok)
    return vocab is not None and model.vocab_sha256 is not None and vocab_digest(vocab) == model.vocab_sha256


def _mlx_core(config: Any, backend: Any, device: Any) -> DrafterCore:
    from engine.mlx.draft_model import MlxDraftModel
    from engine.models import resolve_model

    path = resolve_model(config.draft_model, draft=True).resolve()
    try:
        target = resolve_model(config.model).resolve()
    except FileNotFoundError:
        target = None
    if target is not None and path == target:
        raise InvalidRequest(
            "draft_model is the target model itself; a drafter must be a smaller model "
            "(loading the target twice only doubles its memory)",
            "draft_model",
        )
    model = device.call(MlxDraftModel, path, config.qmm_kernel)
    if not _shares_tokenizer(backend.tokenizer, model):
        raise InvalidRequest(f"draft model {path} does not share the target's tokenizer", "draft_model")
    return ModelDrafterCore(model, name=str(config.draft_model))


def draft_prior(config: Any, core: DrafterCore, backend: Any, device: Any) -> tuple[float, float]:
    """A draft model's step and its catch-up per token, each over the
    target's one-row decode step, measured now: adaptive γ's prices before
    its first measured round (``GammaPolicy(draft_prior=, catch_up_prior=)``).
    Without them a cold engine priced a draft token as prompt lookup's (0.1 of
    a plain round) and a caught-up token at nothing, and four rows arriving
    together drafted γ = 3 behind a drafter at ~0.6–1.0× the target's step:
    0.61–0.72× plain on the fake GPU (tests/ember/test_spec_cold_prior.py).
    ``(0, 0)`` (the model-free priors) for prompt lookup and suffix decoding, and
    under ``--distributed``, where a forward on rank 0 alone would wait for
    the other ranks' shards forever."""
    if not isinstance(core, ModelDrafterCore) or config.distributed:
        return 0.0, 0.0
    timing = getattr(backend, "decode_step_s", None)
    costs = getattr(core.model, "step_costs_s", None)
    if timing is None or costs is None:
        return 0.0, 0.0
    on_device = config.backend != "fake"  # real forwards run on the MLX thread; the fake's costs are its config
    target = device.call(timing) if on_device else timing()
    step, feed = device.call(costs) if on_device else costs()
    if not target > 0:
        return 0.0, 0.0
    log.info("[speculation] draft step %.2fx the target's, a caught-up token %.3fx", step / target, feed / target)
    return step / target, feed / target


# Adaptive γ's acceptance prior for a draft model: how often the drafter's
# argmax equals the target's, teacher-forced over this text (code: what the
# agents this serves mostly generate). Short, so that it costs the target one
# ~60-token forward at start.
AGREEMENT_TEXT = """def mean(values: list[float]) -> float:
    \"\"\"The average of values, 0.0 for an empty list.\"\"\"
    if not values:
        return 0.0
    return sum(values) / len(values)
"""
AGREEMENT_SKIP = 4  # the first positions see almost no context: left out


def accept_prior(config: Any, core: DrafterCore, backend: Any, device: Any) -> float | None:
    """A draft model's top-1 agreement with the target, teacher-forced over
    ``AGREEMENT_TEXT``, measured now: adaptive γ's acceptance per position
    before any round was judged (``GammaPolicy(accept_prior=)``). With the
    fixed prior (0.5) a real pair never drafted: at 0.5 no γ paid, and a draft
    model's catch-up per token (~7% of the 1.5B's step for the 0.5B) is over
    the probe budget, so every row retired before its first draft, where the
    pair accepts ~84% at γ = 1 and fixed γ = 1 measured 1.07x plain
    (docs/bench/spec-real.md). None (the fixed prior) where nothing is
    measured: prompt lookup, suffix decoding, the fake backend, ``--distributed``."""
    if not isinstance(core, ModelDrafterCore) or config.distributed or config.backend == "fake":
        return None
    target_next = getattr(backend, "greedy_next", None)
    draft_next = getattr(core.model, "greedy_next", None)
    tokenizer = getattr(backend, "tokenizer", None)
    if target_next is None or draft_next is None or tokenizer is None:
        return None
    ids = list(tokenizer.encode(AGREEMENT_TEXT))
    if len(ids) <= AGREEMENT_SKIP + 8:
        return None
    want, got = device.call(target_next, ids), device.call(draft_next, ids)
    pairs = list(zip(want, got))[AGREEMENT_SKIP:-1]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    log.info("[speculation] draft model agrees with the target on %.0f%% of %d tokens", 100 * agree, len(pairs))
    return min(0.95, max(0.05, agree))


def build_speculation(config: Any, backend: Any, device: Any, clock: Any) -> Speculation | None:
    name = config.draft_model
    if not name:
        if config.num_draft_tokens is not None:
            raise InvalidRequest("num_draft_tokens needs a draft_model", "num_draft_tokens")
        return None
    if name == "ngram" or name.startswith("ngram:"):
        core: DrafterCore = _ngram_core(name)
    elif name.startswith("suffix"):
        core = _suffix_core(name)
    elif name.startswith("fake-draft"):
        if config.backend != "fake":
            raise InvalidRequest("the fake drafter runs only on the fake backend", "draft_model")
        core = _fake_core(name, config.fake)
    elif config.backend == "fake":
        raise InvalidRequest("on the fake backend draft_model is 'ngram', 'suffix' or 'fake-draft[:p]'", "draft_model")
    else:
        core = _mlx_core(config, backend, device)
    # Prompt lookup and suffix decoding cost a few dict lookups per step, so a
    # held row of a batch can watch its matches instead of probing
    # (GammaPolicy._watch); a draft model would pay a forward per step for it.
    free = isinstance(core, NgramDrafterCore | SuffixDrafterCore)
    watch = WATCH_MATCH if free else None
    try:
        adaptive = config.num_draft_tokens is None
        step, feed = draft_prior(config, core, backend, device) if adaptive else (0.0, 0.0)
        agree = accept_prior(config, core, backend, device) if adaptive else None
        policy = GammaPolicy(
            fixed=config.num_draft_tokens,
            watch_match=watch,
            draft_prior=step,
            catch_up_prior=feed,
            accept_prior=ACCEPT_PRIOR if agree is None else agree,
            free_drafts=free,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc), "num_draft_tokens") from None
    log.info("[speculation] drafter=%s gamma=%s", name, config.num_draft_tokens or "adaptive")
    return Speculation(
        rounds=SpecRounds(
            context_length=backend.info.context_length,
            reach=REACH if isinstance(core, SuffixDrafterCore) else 0,
            learns=isinstance(core, SuffixDrafterCore),
            free_drafts=free,
        ),
        drafter=Drafter(core, device, clock),
        verifier=Verifier(VerifierCore(policy)),
        name=str(pathlib.Path(name).name) if "/" in name else name,
    )
