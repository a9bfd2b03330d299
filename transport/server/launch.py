"""``ember launch claude | codex | opencode [-- ARGS]``: an agent client, unmodified, on Ember.

Starts ``ember serve`` (or reuses the server already answering on the port),
then runs the client with everything it needs set, and returns its exit
status; a server it started stops with it.

- **Claude Code**: ``ANTHROPIC_BASE_URL``, a dummy ``ANTHROPIC_API_KEY``, the
  served model for every slot it uses (``ANTHROPIC_MODEL``, the small/fast
  model of its side requests, the haiku/sonnet/opus/fable defaults and the
  subagent model), the model's real context window (it assumes 200K and
  compacts by it: ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` from 100k tokens up;
  below that, where it cannot compact in time, ``DISABLE_AUTO_COMPACT=1``; and
  ``CLAUDE_CODE_MAX_CONTEXT_TOKENS``, which 2.1.332 reads when compaction is
  off), its output limit (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, the user's own
  value kept where the context allows it) and its
  nonessential traffic off (a local server has no telemetry endpoint).
- **Codex CLI**: its own ``CODEX_HOME`` (under the user's cache directory,
  so the user's ``~/.codex`` is left alone) with a ``config.toml`` naming an
  ``ember`` provider (``wire_api = "responses"``), the model, its context
  window and output limit.
- **OpenCode**: an ``OPENCODE_CONFIG`` file with an ``ember`` provider
  (OpenAI-compatible) and the model's limits.

With ``EMBER_API_KEY`` set (the key ``ember serve`` requires by default),
the probe of ``/v1/models`` sends it, a server it starts inherits it, and the
client is given it: Claude Code as ``ANTHROPIC_API_KEY``, Codex and OpenCode
by reading ``EMBER_API_KEY`` (Codex's ``env_key``, OpenCode's
``{env:EMBER_API_KEY}``), so the key is never written to a file. Without it
they get a dummy key, which a server without ``--api-key`` ignores.

Each launch is one session with one routing key, sent as the header
``X-SMG-Routing-Key`` (Claude Code's ``ANTHROPIC_CUSTOM_HEADERS``, Codex's
provider ``http_headers``, OpenCode's provider ``headers``): behind the SGLang
Model Gateway with ``--policy manual`` every request of the session goes to the
replica that holds its prefix (docs/distributed.md); a single server ignores it.

The server it starts has ``ember serve``'s SSD prompt-cache tier, decided by
the same function (``ember.ssd_tier.resolve_ssd``: one folder per model under
``$EMBER_CACHE_DIR/kv``, else ``~/.cache/ember/kv``), so a session resumed
after a restart still starts warm, a launched session finds the cache a served
one left, and two models never share a folder; ``--ssd-cache DIR`` overrides it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from engine.cache_dir import cache_root

CLIENTS = ("claude", "codex", "opencode")
DUMMY_KEY = "ember"
# the header sglang-router's ``manual`` policy routes by: one key, one replica
ROUTING_HEADER = "X-SMG-Routing-Key"


def routing_key() -> str:
    """A fresh session's routing key."""
    return f"ember-launch-{uuid.uuid4().hex}"


def cache_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    return pathlib.Path(cache_root(environ))


def server_args(serve_args: Sequence[str], host: str, ssd_cache: str | None = None) -> list[str]:
    """The flags of the ``ember serve`` a launch starts: no SSD folder of its
    own unless asked, so ``serve``'s default decides it (ember/ssd_tier.py)."""
    args = [*serve_args, "--host", host]
    if ssd_cache and "--ssd-cache" not in args:
        args += ["--ssd-cache", ssd_cache]
    return args


def api_key(environ: Mapping[str, str]) -> str | None:
    """The key the server wants, as ``ember serve`` reads it (``--api-key``'s default)."""
    return environ.get("EMBER_API_KEY") or None


class KeyRefused(Exception):
    """The server answering at the URL wants an API key this launch does not have."""


def served_model(url: str, timeout_s: float = 2.0, key: str | None = None) -> tuple[str, int | None] | None:
    """(name, context length) of the server answering at ``url``, or None when
    none answers; ``KeyRefused`` when one answers 401 to ``key``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=timeout_s
        ) as r:
            card = json.load(r)["data"][0]
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise KeyRefused(url) from None
        return None
    except (OSError, ValueError, KeyError, IndexError):
        return None
    ctx = card.get("context_length") or card.get("max_model_len")
    return str(card["id"]), int(ctx) if ctx else None


# Claude Code (2.1.332) reads CLAUDE_CODE_AUTO_COMPACT_WINDOW as at least 100k
# ("treats it as the 100k minimum") and reserves its reply budget plus a buffer
# under the window, so below 100k tokens of context it cannot compact in time:
# on an 8k model every turn began by compacting (a "compacting" status, a
# failed compaction, the session past 600 s, measured on SmolLM2). There
# auto-compaction is off and the window is not set; the context is still told
# (CLAUDE_CODE_MAX_CONTEXT_TOKENS), a turn that outgrows it is refused by
# Ember's limit check, and /compact stays at hand.
AUTO_COMPACT_MIN_CONTEXT = 100_000


def output_limit(context: int) -> int:
    """The reply budget the client is told: a quarter of the context, at most 32k."""
    return max(256, min(32_000, context // 4))


def client_env(
    client: str,
    url: str,
    model: str,
    context: int,
    environ: Mapping[str, str],
    home: pathlib.Path,
    session: str | None = None,
) -> dict[str, str]:
    """The client's environment: the caller's, with everything Ember needs set;
    ``session``: the routing key its requests carry (``ROUTING_HEADER``)."""
    env = dict(environ)
    out = output_limit(context)
    session = session or routing_key()
    if client == "claude":
        env.update(
            ANTHROPIC_BASE_URL=url,
            ANTHROPIC_API_KEY=api_key(env) or DUMMY_KEY,
            ANTHROPIC_MODEL=model,
            ANTHROPIC_SMALL_FAST_MODEL=model,
            ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
            ANTHROPIC_DEFAULT_SONNET_MODEL=model,
            ANTHROPIC_DEFAULT_OPUS_MODEL=model,
            ANTHROPIC_DEFAULT_FABLE_MODEL=model,
            CLAUDE_CODE_SUBAGENT_MODEL=model,
            CLAUDE_CODE_MAX_CONTEXT_TOKENS=str(context),
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        )
        if context < AUTO_COMPACT_MIN_CONTEXT:
            env.setdefault("DISABLE_AUTO_COMPACT", "1")
        else:
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(context)
        # a reply budget the user set is theirs (a CPU machine wants short turns);
        # above what the context allows it is lowered to that
        user_out = env.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "")
        keep = user_out.isdigit() and 0 < int(user_out) <= out
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = user_out if keep else str(out)
        headers = [h for h in env.get("ANTHROPIC_CUSTOM_HEADERS", "").splitlines() if h.strip()]
        headers = [h for h in headers if h.split(":", 1)[0].strip().lower() != ROUTING_HEADER.lower()]
        env["ANTHROPIC_CUSTOM_HEADERS"] = "\n".join([*headers, f"{ROUTING_HEADER}: {session}"])
        env.pop("ANTHROPIC_AUTH_TOKEN", None)  # it would be sent instead of the key
    elif client == "codex":
        codex_home = home / "codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(url, model, context, session))
        env["CODEX_HOME"] = str(codex_home)
        env["EMBER_API_KEY"] = api_key(env) or DUMMY_KEY  # its provider's env_key
    elif client == "opencode":
        path = home / "opencode.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(opencode_config(url, model, context, session), indent=2))
        env["OPENCODE_CONFIG"] = str(path)
        env["EMBER_API_KEY"] = api_key(env) or DUMMY_KEY  # its provider's apiKey reads it
    else:
        raise ValueError(f"unknown client {client!r} ({', '.join(CLIENTS)})")
    return env


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a TOML basic string


def codex_config(url: str, model: str, context: int, session: str | None = None) -> str:
    headers = f"http_headers = {{ {_toml_str(ROUTING_HEADER)} = {_toml_str(session)} }}\n" if session else ""
    # No model_max_output_tokens: Codex 0.171 ignores it and warns on every run.
    return (
        f"model = {_toml_str(model)}\n"
        'model_provider = "ember"\n'
        f"model_context_window = {context}\n"
        f"model_auto_compact_token_limit = {int(context * 0.9)}\n"
        "\n[model_providers.ember]\n"
        'name = "Ember"\n'
        f"base_url = {_toml_str(url + '/v1')}\n"
        'wire_api = "responses"\n'
        'env_key = "EMBER_API_KEY"\n'
        f"{headers}"
    )


def opencode_config(url: str, model: str, context: int, session: str | None = None) -> dict[str, Any]:
    # OpenCode substitutes {env:NAME} when it reads its config: the key stays out of the file
    options: dict[str, Any] = {"baseURL": f"{url}/v1", "apiKey": "{env:EMBER_API_KEY}"}
    if session:
        options["headers"] = {ROUTING_HEADER: session}
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": f"ember/{model}",
        "small_model": f"ember/{model}",
        "provider": {
            "ember": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Ember",
                "options": options,
                "models": {model: {"name": model, "limit": {"context": context, "output": output_limit(context)}}},
            }
        },
    }


def start_server(
    serve_args: Sequence[str], port: int, timeout_s: float = 900, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``ember serve SERVE_ARGS --port PORT`` (in ``env``: its ``EMBER_API_KEY`` is
    the key it requires); returns once it printed its URL."""
    argv = [sys.executable, "-m", "transport.cli", "serve", *serve_args, "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=None if env is None else dict(env))
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        sys.stderr.write(line)
        if line.startswith("ember: serving"):
            return proc, line.split(" at ", 1)[1].split()[0]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"ember serve did not start (exit {proc.wait()})")


def launch(
    client: str,
    client_args: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    serve_args: Sequence[str] = (),
    ssd_cache: str | None = None,
    binary: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``client`` against a reused or started server; its exit status."""
    environ = dict(os.environ if environ is None else environ)
    exe = binary or shutil.which(client)
    if exe is None:
        print(f"ember launch: `{client}` is not on PATH (npm install -g the client, or --bin PATH)", file=sys.stderr)
        return 2
    url = f"http://{host}:{port}"
    proc = None
    key = api_key(environ)  # a server started here reads the same variable
    try:
        found = served_model(url, key=key)
        if found is None:
            proc, url = start_server(server_args(serve_args, host, ssd_cache), port, env=environ)
            found = served_model(url, key=key)
            if found is None:
                proc.terminate()
                print(f"ember launch: the server at {url} does not answer /v1/models", file=sys.stderr)
                return 1
        else:
            print(f"ember launch: reusing the server at {url}", file=sys.stderr)
    except KeyRefused:
        if proc is not None:
            proc.terminate()
        have = "refuses EMBER_API_KEY" if key else "wants an API key: set EMBER_API_KEY to it"
        print(f"ember launch: the server at {url} {have}", file=sys.stderr)
        return 1
    model, context = found
    context = context or 8192
    env = client_env(client, url, model, context, environ, cache_dir(environ) / "launch")
    print(f"ember launch: {client} on {model} ({context} tokens of context) at {url}", file=sys.stderr, flush=True)
    try:
        return subprocess.call([exe, *client_args], env=env)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
