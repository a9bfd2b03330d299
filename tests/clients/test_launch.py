"""``ember launch``: with a fake client (a script that dumps what it was
given and exits 7), the server it starts or reuses, and everything it sets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib

import pytest

from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

FAKE_CLIENT = r"""#!PYTHON
import json, os, sys, urllib.error, urllib.request
env = dict(os.environ)
files = {}
for key in ("CODEX_HOME", "OPENCODE_CONFIG"):
    if key in env:
        path = os.path.join(env[key], "config.toml") if key == "CODEX_HOME" else env[key]
        files[key] = open(path).read()
url = env.get("ANTHROPIC_BASE_URL") or "URL_UNKNOWN"
models = None
keyless = None  # the status the server gives a request without the key
if url != "URL_UNKNOWN":
    # as Claude Code sends its key
    req = urllib.request.Request(url + "/v1/models", headers={"x-api-key": env["ANTHROPIC_API_KEY"]})
    models = json.load(urllib.request.urlopen(req))
    try:
        keyless = urllib.request.urlopen(url + "/v1/models").status
    except urllib.error.HTTPError as exc:
        keyless = exc.code
json.dump({"argv": sys.argv[1:], "env": env, "files": files, "models": models, "keyless": keyless}, open(os.environ["DUMP"], "w"))
sys.exit(7)
"""


def _fake(tmp_path):
    path = tmp_path / "fake-client"
    path.write_text(FAKE_CLIENT.replace("PYTHON", sys.executable))
    path.chmod(0o755)
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"context_length": 100000, "rules": []}))
    return path, script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, client, *extra, key=None):
    fake, script = _fake(tmp_path)
    env = {**os.environ, "DUMP": str(tmp_path / "dump.json"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("EMBER_API_KEY", None)
    if key is not None:
        env["EMBER_API_KEY"] = key
    argv = [sys.executable, "-m", "transport.cli", "launch", client, "--bin", str(fake), *extra]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    return res, json.loads((tmp_path / "dump.json").read_text()), script


def test_claude_gets_every_model_slot_the_context_and_a_started_server(tmp_path):
    fake, script = _fake(tmp_path)
    res, dump, _ = _launch(
        tmp_path, "claude", "--model", f"scripted:{script}", "--port", str(_free_port()), "--", "-p", "hi"
    )
    assert res.returncode == 7, res.stderr  # the client's own exit status
    assert dump["argv"] == ["-p", "hi"]
    env = dump["env"]
    for slot in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    ):
        assert env[slot] == "scripted", slot
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "100000"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "25000"
    assert env["ANTHROPIC_API_KEY"]
    # the server it started was up while the client ran, reports the context, and had the SSD tier on
    assert dump["models"]["data"][0]["context_length"] == 100000
    # ... in serve's own folder for the model (ember/ssd_tier.py), not one of launch's
    assert f"SSD prompt cache {os.path.join(os.environ['EMBER_KV_CACHE_DIR'], script.name)}-" in res.stderr, res.stderr
    assert not (tmp_path / "cache" / "ember" / "ssd").exists()


def test_codex_gets_a_responses_provider_and_a_running_server_is_reused(tmp_path):
    fake, script = _fake(tmp_path)
    with ember_serve("--model", f"scripted:{script}") as (proc, url):
        port = url.rsplit(":", 1)[1]
        res, dump, _ = _launch(tmp_path, "codex", "--port", port, "--", "exec", "hi")
        assert res.returncode == 7, res.stderr
        assert "reusing the server" in res.stderr
    cfg = tomllib.loads(dump["files"]["CODEX_HOME"])
    assert cfg["model"] == "scripted" and cfg["model_provider"] == "ember"
    assert cfg["model_context_window"] == 100000
    assert "model_max_output_tokens" not in cfg  # Codex 0.171 ignores it and warns on every run
    provider = cfg["model_providers"]["ember"]
    assert provider["wire_api"] == "responses" and provider["base_url"] == f"{url}/v1"
    assert dump["env"][provider["env_key"]]
    assert dump["argv"] == ["exec", "hi"]


def test_opencode_gets_a_provider_with_the_limits(tmp_path):
    fake, script = _fake(tmp_path)
    with ember_serve("--model", f"scripted:{script}") as (proc, url):
        res, dump, _ = _launch(tmp_path, "opencode", "--port", url.rsplit(":", 1)[1], "--", "run", "hi")
        assert res.returncode == 7, res.stderr
    cfg = json.loads(dump["files"]["OPENCODE_CONFIG"])
    assert cfg["model"] == "ember/scripted"
    prov = cfg["provider"]["ember"]
    assert prov["options"]["baseURL"] == f"{url}/v1"
    assert prov["models"]["scripted"]["limit"]["context"] == 100000


def test_a_reply_budget_the_user_set_is_kept_up_to_what_the_context_allows(tmp_path):
    from transport.server.launch import client_env, output_limit

    def budget(user: str | None) -> str:
        environ = {} if user is None else {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": user}
        return client_env("claude", "http://x", "m", 8192, environ, tmp_path)["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]

    assert output_limit(8192) == 2048
    assert budget(None) == "2048"
    assert budget("256") == "256"  # shorter turns on a CPU machine: the user's call
    assert budget("32000") == "2048"  # more than the context leaves: lowered
    assert budget("lots") == budget("0") == "2048"


def test_auto_compaction_is_off_where_the_context_cannot_hold_claude_codes_reserve(tmp_path):
    from transport.server.launch import AUTO_COMPACT_MIN_CONTEXT, client_env

    small = client_env("claude", "http://x", "m", 8192, {}, tmp_path)
    large = client_env("claude", "http://x", "m", AUTO_COMPACT_MIN_CONTEXT, {}, tmp_path)
    assert small["DISABLE_AUTO_COMPACT"] == "1" and "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in small
    assert small["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"
    assert "DISABLE_AUTO_COMPACT" not in large and large["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(
        AUTO_COMPACT_MIN_CONTEXT
    )
    # the user's own choice stands
    assert client_env("claude", "u", "m", 8192, {"DISABLE_AUTO_COMPACT": "0"}, tmp_path)["DISABLE_AUTO_COMPACT"] == "0"


KEY = "sk-launch-test"


def test_with_ember_api_key_set_a_started_server_requires_it_and_claude_is_given_it(tmp_path):
    fake, script = _fake(tmp_path)
    res, dump, _ = _launch(tmp_path, "claude", "--model", f"scripted:{script}", "--port", str(_free_port()), key=KEY)
    assert res.returncode == 7, res.stderr  # the probe sent the key: the client ran
    assert dump["env"]["ANTHROPIC_API_KEY"] == KEY
    assert dump["models"]["data"][0]["id"] == "scripted"  # with the key it was given
    assert dump["keyless"] == 401  # the started server did require it


@pytest.mark.parametrize("client", ["codex", "opencode"])
def test_with_ember_api_key_set_a_reused_server_is_probed_with_it_and_the_client_reads_it(tmp_path, client):
    fake, script = _fake(tmp_path)
    with ember_serve("--model", f"scripted:{script}", "--api-key", KEY) as (proc, url):
        res, dump, _ = _launch(tmp_path, client, "--port", url.rsplit(":", 1)[1], key=KEY)
        assert res.returncode == 7, res.stderr
        assert "reusing the server" in res.stderr
        # no key: a clear error, not a second server on a busy port
        bad, _, _ = _launch(tmp_path, client, "--port", url.rsplit(":", 1)[1], key="")
        assert bad.returncode == 1 and "set EMBER_API_KEY" in bad.stderr, bad.stderr
    assert dump["env"]["EMBER_API_KEY"] == KEY
    if client == "codex":
        assert tomllib.loads(dump["files"]["CODEX_HOME"])["model_providers"]["ember"]["env_key"] == "EMBER_API_KEY"
    else:
        options = json.loads(dump["files"]["OPENCODE_CONFIG"])["provider"]["ember"]["options"]
        assert options["apiKey"] == "{env:EMBER_API_KEY}" and KEY not in dump["files"]["OPENCODE_CONFIG"]
