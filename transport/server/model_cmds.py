"""``ember pull``, ``ember ls`` and ``ember rm``: the models on this machine.

    ember pull mlx-community/Qwen3-4B-4bit     download into huggingface_hub's cache (a GGUF: and convert)
    ember ls [--json]                           what can be served here, with size, format and tool support
    ember rm mlx-community/Qwen3-4B-4bit --yes  delete a hub model's cache entry (or a converted GGUF directory)

The model logic is ``engine.models.hub`` and ``engine.models.catalog``; this
module parses, asks and prints. A failure is one line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("pull", help="download a Hugging Face model (ORG/NAME[@REVISION][:QUANT]) for serving")
    p.add_argument("name", help="e.g. mlx-community/Qwen3-4B-4bit or unsloth/Qwen3-4B-GGUF:Q4_K_M")
    p.set_defaults(run=pull, parser=p)

    ls = sub.add_parser("ls", help="list the models this machine can serve without downloading")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument(
        "--models-dir", default="~/.cache/ember/models", metavar="DIR", help="as `ember serve --models-dir`"
    )
    ls.set_defaults(run=list_models, parser=ls)

    rm = sub.add_parser("rm", help="delete a downloaded hub model or a converted GGUF directory")
    rm.add_argument("name", help="a hub name (ORG/NAME) or a converted directory under ~/.cache/ember/gguf")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask")
    rm.set_defaults(run=remove, parser=rm)


def _fail(msg: str) -> int:
    print(f"ember: error: {msg}", file=sys.stderr, flush=True)
    return 1


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def pull(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import logging

    from engine.models import hub

    logging.basicConfig(level="WARNING", format="%(message)s")
    logging.getLogger("ember.hub").setLevel("INFO")  # its found/pulled lines, not every HTTP request
    ref = hub.parse(args.name)
    if ref is None:
        parser.error(f"{args.name!r} is not a hub name (ORG/NAME[@REVISION][:QUANT])")
    try:
        path = hub.resolve(ref)
    except (hub.HubError, ValueError) as exc:  # ValueError: a GGUF that cannot convert
        return _fail(str(exc))
    print(f"ember: {ref} is at {path}; serve it with: ember serve --model {ref}", flush=True)
    return 0


def list_models(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import pathlib

    from ember.registry import discover
    from engine.models import catalog

    rows = catalog.list_models()
    for name, kind, path in discover(args.models_dir):
        if kind == "chat":
            rows.append(catalog.describe(pathlib.Path(path), name, "models-dir"))
    if args.json:
        for r in rows:
            print(json.dumps(r.row()), flush=True)
        return 0
    table = [("NAME", "SOURCE", "FORMAT", "SIZE", "TOOLS")]
    for r in rows:
        tools = "?" if r.tools is None else ("yes" if r.tools else "no")
        table.append((r.name, r.source, r.format, _gib(r.size_bytes), tools))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), flush=True)
    return 0


def remove(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine.models import catalog, hub

    try:
        kind, dirs, size = catalog.removal(args.name)
    except hub.HubError as exc:
        return _fail(str(exc))
    what = f"{args.name} ({'hub cache' if kind == 'hub' else 'converted'}, {_gib(size)}"
    what += (
        f", with {len(dirs)} converted director{'y' if len(dirs) == 1 else 'ies'})" if kind == "hub" and dirs else ")"
    )
    if not args.yes:
        try:
            answer = input(f"remove {what}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("ember: nothing removed", flush=True)
            return 1
    try:
        freed = catalog.remove(args.name)
    except (hub.HubError, OSError) as exc:
        return _fail(str(exc))
    print(f"ember: removed {args.name} ({_gib(freed)} freed)", flush=True)
    return 0
