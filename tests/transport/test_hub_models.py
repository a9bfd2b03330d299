"""Hub names through the server and the CLI, against a local stand-in for the hub
(tests/hub_server.py): `ember pull` / `ls` / `rm` as a user runs them (subprocesses, so
HF_ENDPOINT and HF_HUB_CACHE are read at huggingface_hub's import as in real use); a
request naming a hub model not downloaded is a 404 unless the server allows pulls, and an
allowed pull runs off the loop while the default model keeps serving; /health shows the
progress of the pull at start; `ember serve` of an unknown repo is one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import anyio
import httpx
import pytest
from huggingface_hub import constants

from ember import EngineConfig, load_ports
from ember import registry as registry_mod
from engine.fake.gpu import FakeBackend
from engine.mlx.blas import OPT_OUT
from engine.models import BUNDLED, hub
from tests.hub_server import FakeHub
from transport.server.http import build_app

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::ResourceWarning")]

TINY = {p.name: p.read_bytes() for p in sorted(BUNDLED["tiny"].iterdir()) if p.is_file()}


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    server = FakeHub()
    server.add("org/tiny", TINY)
    with server.serving() as url:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hub, "lmstudio_roots", lambda: [tmp_path / "lmstudio"])
        yield server, url


def _env(tmp_path, url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {
        **env,
        OPT_OUT: "1",
        "HF_ENDPOINT": url,
        "HF_HOME": str(tmp_path / "hf_home"),  # no token file of this machine's
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "EMBER_CACHE_DIR": str(tmp_path / "ember"),
        "LMSTUDIO_MODELS_DIR": str(tmp_path / "lmstudio"),
        **extra,
    }


def ember(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transport.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _ls(env: dict[str, str]) -> dict[str, dict]:
    r = ember(env, "ls", "--json", "--models-dir", "/nonexistent")
    assert r.returncode == 0, r.stderr
    return {row["name"]: row for row in map(json.loads, r.stdout.splitlines())}


def test_pull_ls_rm_as_a_user_runs_them(fake_hub, tmp_path):
    server, url = fake_hub
    env = _env(tmp_path, url)
    assert "org/tiny" not in _ls(env)
    r = ember(env, "pull", "org/tiny")
    assert r.returncode == 0, r.stderr
    assert "ember serve --model org/tiny" in r.stdout
    assert {p.rsplit("/", 1)[1] for p in server.downloads()} == set(TINY)
    row = _ls(env)["org/tiny"]
    assert row["source"] == "hub" and row["format"] == "safetensors float32" and row["tools"] is True
    assert row["size_bytes"] == sum(map(len, TINY.values()))
    assert _ls(env)["tiny"]["source"] == "bundled"
    n = len(server.requests)
    r = ember(env, "pull", "org/tiny")  # already here: found, nothing fetched
    assert r.returncode == 0 and len(server.requests) == n
    r = subprocess.run(
        [sys.executable, "-m", "transport.cli", "rm", "org/tiny"], input="n\n", capture_output=True, text=True, env=env
    )
    assert r.returncode == 1 and "nothing removed" in r.stdout and "org/tiny" in _ls(env)
    r = ember(env, "rm", "org/tiny", "--yes")
    assert r.returncode == 0, r.stderr
    assert "org/tiny" not in _ls(env)
    r = ember(env, "rm", "org/tiny", "--yes")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "neither in the hub cache" in r.stderr


def test_pull_errors_are_one_line(fake_hub, tmp_path):
    server, url = fake_hub
    r = ember(_env(tmp_path, url), "pull", "org/nope")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("ember: error: no model org/nope on")
    assert "Traceback" not in r.stderr
    r = ember(_env(tmp_path, url, HF_HUB_OFFLINE="1"), "pull", "org/tiny")
    assert r.returncode == 1 and "org/tiny is not downloaded" in r.stderr and str(tmp_path / "hub") in r.stderr
    assert server.downloads() == []


def test_serve_offline_and_not_cached_exits_2_before_binding(fake_hub, tmp_path):
    _, url = fake_hub
    r = ember(_env(tmp_path, url, HF_HUB_OFFLINE="1"), "serve", "--model", "org/tiny", "--port", "0")
    assert r.returncode == 2 and "org/tiny is not downloaded" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # a server subprocess that imports MLX
def test_serve_of_an_unknown_repo_is_one_line_and_a_nonzero_exit(fake_hub, tmp_path):
    _, url = fake_hub
    r = ember(_env(tmp_path, url), "serve", "--model", "org/nope", "--port", "0", "--log-level", "error")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ember: error: the engine did not start:") and "no model org/nope" in last


def _fake_load(release: threading.Event | None = None, seen: list[str] | None = None):
    """load_ports that resolves the model as the MLX backend does (a hub name: the pull), then
    serves the fake GPU in its place."""
    from engine.models import resolve_model

    def load(config, ports, *, keep_events=None):
        if seen is not None:
            seen.append(threading.current_thread().name)
        resolve_model(config.model)
        if release is not None:
            release.wait(30)
        ports.backend = FakeBackend(config.fake)
        return load_ports(config, ports, keep_events=keep_events)

    return load


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real loop: models load on threads
async def test_health_shows_the_pull_at_start(fake_hub, monkeypatch):
    server, _ = fake_hub
    release = threading.Event()
    server.hold[("org/tiny", "model.safetensors")] = release
    monkeypatch.setattr(registry_mod, "load_ports", _fake_load())
    app = build_app(EngineConfig(backend="mlx", model="org/tiny"))
    size = len(TINY["model.safetensors"])
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            with anyio.fail_after(30):
                while True:
                    r = await client.get("/health")
                    pulls = r.json().get("pulls")
                    if pulls and pulls[0]["done_bytes"] >= size // 2:
                        break
                    await anyio.sleep(0.05)
            assert r.status_code == 503 and r.json()["status"] == "starting"
            assert pulls[0]["model"] == "org/tiny" and pulls[0]["total_bytes"] >= size > pulls[0]["done_bytes"]
            release.set()
            with anyio.fail_after(30):
                await app.state.ember.settled.wait()
            r = await client.get("/health")
            assert r.status_code == 200 and r.json() == {"status": "ready", "loaded": ["org/tiny"]}


async def _chat(client: httpx.AsyncClient, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return await client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_request_never_pulls_unasked(fake_hub, monkeypatch):
    server, _ = fake_hub
    monkeypatch.setattr(registry_mod, "load_ports", _fake_load())
    app = build_app(EngineConfig(backend="mlx", model="tiny"), registry_kw={"allow_pulls": ("other/*",)})
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            r = await _chat(client, "org/tiny")
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model"
            assert "ember pull org/tiny" in err["message"] and "--allow-pulls" in err["message"]
            assert server.requests == []
            ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            assert "org/tiny" not in ids


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_allowed_pull_runs_off_the_loop_while_the_default_serves(fake_hub, monkeypatch):
    server, _ = fake_hub
    hold = threading.Event()
    threads: list[str] = []
    monkeypatch.setattr(registry_mod, "load_ports", _fake_load(seen=threads))
    app = build_app(EngineConfig(backend="mlx", model="tiny"), registry_kw={"allow_pulls": ("org/*",)})
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        server.hold[("org/tiny", "model.safetensors")] = hold
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            got: list[httpx.Response] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: _append(got, _chat(client, "org/tiny")))
                with anyio.fail_after(30):
                    while not hub.in_flight():
                        await anyio.sleep(0.05)
                    r = await _chat(client, "tiny")  # the other model's traffic is not blocked
                assert r.status_code == 200 and not got
                hold.set()
            assert got[0].status_code == 200, got[0].text
            assert got[0].json()["model"] == "org/tiny"
            assert threads[-1] != threading.main_thread().name  # the pull ran on a worker thread
            r = await _chat(client, "org/nope")  # allowed, but the hub has no such repo: the load fails
            assert r.status_code == 500 and "no model org/nope" in r.json()["error"]["message"]
            assert "org/nope" not in app.state.ember.registry.entries  # a failed pull leaves no name behind


async def _append(out: list, coro) -> None:
    out.append(await coro)


def test_a_hub_names_ssd_folder_is_the_same_from_any_working_directory(tmp_path, monkeypatch):
    from ember.ssd_folders import model_key

    here = model_key("org/tiny")
    monkeypatch.chdir(tmp_path)
    assert model_key("org/tiny") == here and here.startswith("tiny-")
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a directory of that name is a path, as before
    assert model_key("org/tiny") != here
