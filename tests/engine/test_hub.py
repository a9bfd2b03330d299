"""engine.models.hub against a local stand-in for the Hugging Face Hub (tests/hub_server.py):
a first pull, a resumed pull, a second start that fetches nothing, a 404, a gated repo, a
corrupted file, offline with and without the cache, GGUF quant tags, LM Studio's folder,
progress while a pull runs. No test reaches the real hub: huggingface_hub's endpoint and
cache constants (read at its import) are patched to the local server and a temp folder."""

from __future__ import annotations

import hashlib
import json
import pathlib
import threading
import time

import pytest
from huggingface_hub import constants

from engine.models import BUNDLED, hub, resolve_model
from tests.hub_server import FakeHub

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # the cut connection's socket, closed by the server

TINY = {p.name: p.read_bytes() for p in sorted(BUNDLED["tiny"].iterdir()) if p.is_file()}


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """(FakeHub, its URL) with huggingface_hub pointed at it, an empty cache, and no token."""
    server = FakeHub()
    server.add("org/tiny", TINY)
    with server.serving() as url:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("LMSTUDIO_MODELS_DIR", str(tmp_path / "lmstudio"))
        monkeypatch.setattr(hub, "lmstudio_roots", lambda: [tmp_path / "lmstudio"])
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        yield server, url


def _same_as_tiny(path: pathlib.Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (path / name).read_bytes() == TINY[name], name


def test_parse_hub_names():
    assert hub.parse("mlx-community/Qwen3-4B-4bit") == hub.HubRef("mlx-community/Qwen3-4B-4bit")
    assert hub.parse("org/x@v1.0:Q4_K_M") == hub.HubRef("org/x", "v1.0", "Q4_K_M")
    assert hub.parse("hf.co/unsloth/Qwen3-4B-GGUF:q4_k_m") == hub.HubRef("unsloth/Qwen3-4B-GGUF", None, "q4_k_m")
    for not_hub in ("tiny", "/abs/path", "./rel/dir", "~/m/x", "a/b/c", "scripted:x.json", "a/../b", "dir/x.gguf"):
        assert hub.parse(not_hub) is None, not_hub


def test_first_pull_then_a_second_start_fetches_nothing(fake_hub):
    server, _ = fake_hub
    path = resolve_model("org/tiny")
    _same_as_tiny(path)
    assert "training_log.json" in {p.name for p in path.iterdir()}  # *.json is in mlx-lm's patterns
    got = {p.rsplit("/", 1)[1] for p in server.downloads()}
    assert got == set(TINY)
    assert hub.in_flight() == []
    server.requests.clear()
    assert resolve_model("org/tiny") == path
    assert server.requests == []  # found in the cache, not a byte (nor a HEAD) fetched


def test_a_pull_resumes_after_the_connection_drops(fake_hub):
    server, _ = fake_hub
    server.cut_once.add(("org/tiny", "model.safetensors"))
    path = hub.fetch(hub.parse("org/tiny"))
    _same_as_tiny(path)
    assert [r for p, r in server.ranges if p.endswith("model.safetensors")] == ["bytes=10485760-"]
    assert not server.cut_once  # the cut happened


def test_unknown_repo_and_gated_repo_are_one_line_each(fake_hub):
    server, url = fake_hub
    with pytest.raises(hub.HubError) as e:
        resolve_model("org/nope")
    assert "no model org/nope" in str(e.value) and url in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(hub.HubError, match="org/tiny has no revision 'v9'"):
        resolve_model("org/tiny@v9")
    server.add("org/gated", TINY)
    server.gated.add("org/gated")
    with pytest.raises(hub.HubError, match="org/gated is gated: .*set HF_TOKEN") as e:
        resolve_model("org/gated")
    assert "\n" not in str(e.value)


def test_hf_token_opens_a_gated_repo(fake_hub, monkeypatch):
    server, _ = fake_hub
    server.add("org/gated", TINY)
    server.gated.add("org/gated")
    monkeypatch.setenv("HF_TOKEN", server.token)
    _same_as_tiny(resolve_model("org/gated"))


def test_a_corrupted_file_fails_the_pull_and_nothing_is_served(fake_hub):
    server, _ = fake_hub
    bad = bytearray(TINY["model.safetensors"])
    bad[-1] ^= 0xFF  # same size: only a hash can tell
    server.corrupt[("org/tiny", "model.safetensors")] = bytes(bad)
    with pytest.raises(hub.HubError, match="model.safetensors does not match its sha256"):
        resolve_model("org/tiny")
    assert hub.local_path(hub.parse("org/tiny")) is None  # no half model left to serve
    blobs = pathlib.Path(constants.HF_HUB_CACHE) / "models--org--tiny" / "blobs"
    assert hashlib.sha256(TINY["model.safetensors"]).hexdigest() not in {p.name for p in blobs.iterdir()}
    del server.corrupt[("org/tiny", "model.safetensors")]
    _same_as_tiny(resolve_model("org/tiny"))  # the next pull fetches the file again


def test_offline_without_and_with_the_cache(fake_hub, monkeypatch):
    server, _ = fake_hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.HubError, match="org/tiny is not downloaded") as e:
        resolve_model("org/tiny")
    assert constants.HF_HUB_CACHE in str(e.value) and "HF_HUB_OFFLINE=1" in str(e.value)
    with pytest.raises(hub.HubError):
        hub.preflight(hub.parse("org/tiny"))  # what `ember serve` checks before it binds
    assert server.requests == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    path = resolve_model("org/tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    server.requests.clear()
    assert resolve_model("org/tiny") == path
    hub.preflight(hub.parse("org/tiny"))
    assert server.requests == []


def test_gguf_repo_takes_the_file_named_by_the_quant_tag(fake_hub):
    server, _ = fake_hub
    files = {"x-Q4_K_M.gguf": b"GGUF-q4km", "x-Q4_K_S.gguf": b"GGUF-q4ks", "x-Q8_0.gguf": b"GGUF-q8", "README.md": b"#"}
    server.add("org/x-GGUF", files)
    with pytest.raises(hub.HubError, match="2 files match :Q4_K"):
        hub.fetch(hub.parse("org/x-GGUF:Q4_K"))
    with pytest.raises(hub.HubError, match="name one with :QUANT"):
        hub.fetch(hub.parse("org/x-GGUF"))
    assert server.downloads() == []
    path = hub.fetch(hub.parse("org/x-GGUF:q4_k_m"))  # case-insensitive, whole tag over a prefix
    assert path.name == "x-Q4_K_M.gguf" and path.read_bytes() == b"GGUF-q4km"
    assert [p.rsplit("/", 1)[1] for p in server.downloads()] == ["x-Q4_K_M.gguf"]  # not the other quants
    server.requests.clear()
    assert hub.fetch(hub.parse("org/x-GGUF:Q4_K_M")) == path and server.requests == []


def test_lm_studio_folder_is_a_place_a_model_already_is(fake_hub, tmp_path):
    server, _ = fake_hub
    d = tmp_path / "lmstudio" / "lmstudio-community" / "tiny-MLX"
    d.mkdir(parents=True)
    for name, data in TINY.items():
        (d / name).write_bytes(data)
    assert resolve_model("lmstudio-community/tiny-MLX") == d
    half = tmp_path / "lmstudio" / "lmstudio-community" / "sharded-MLX"  # an index naming a shard not there
    half.mkdir()
    (half / "config.json").write_text("{}")
    (half / "model-00001-of-00002.safetensors").write_bytes(b"x")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (half / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert hub.local_path(hub.parse("lmstudio-community/sharded-MLX")) is None
    (half / "model-00002-of-00002.safetensors").write_bytes(b"x")
    assert hub.local_path(hub.parse("lmstudio-community/sharded-MLX")) == half
    g = tmp_path / "lmstudio" / "lmstudio-community" / "x-GGUF"
    g.mkdir()
    (g / "x-Q8_0.gguf").write_bytes(b"GGUF")
    assert hub.fetch(hub.parse("lmstudio-community/x-GGUF:Q8_0")) == g / "x-Q8_0.gguf"
    assert server.requests == []


def test_progress_while_a_pull_runs(fake_hub):
    server, _ = fake_hub
    release = threading.Event()
    server.hold[("org/tiny", "model.safetensors")] = release
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(hub.fetch(hub.parse("org/tiny"))))
    t.start()
    try:
        size = len(TINY["model.safetensors"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pulls = hub.in_flight()
            if pulls and pulls[0]["done_bytes"] >= size // 2:
                break
            time.sleep(0.05)
        assert pulls and pulls[0]["model"] == "org/tiny"
        assert size // 2 <= pulls[0]["done_bytes"] < size <= pulls[0]["total_bytes"]
    finally:
        release.set()
        t.join(30)
    assert isinstance(result[0], pathlib.Path) and hub.in_flight() == []


def test_disk_full_is_one_line_and_nothing_is_served(fake_hub, monkeypatch):
    import errno

    from huggingface_hub import file_download

    real = file_download.http_get

    def full_disk(url, temp_file, **kw):  # the write that finds the disk full, mid-file
        if url.endswith("model.safetensors"):
            temp_file.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(url, temp_file, **kw)

    monkeypatch.setattr(file_download, "http_get", full_disk)
    with pytest.raises(hub.HubError, match="disk full while downloading org/tiny into .*hub; free space"):
        resolve_model("org/tiny")
    assert hub.local_path(hub.parse("org/tiny")) is None and hub.in_flight() == []


def test_a_gguf_pulled_by_quant_tag_is_converted_listed_and_removed_with_its_conversion(
    fake_hub, tmp_path, monkeypatch
):
    pytest.importorskip("gguf", reason="the GGUF reader is the `models` / `test` extra")
    from engine.models import catalog
    from tests.engine.test_gguf_convert import write_llama_gguf

    server, _ = fake_hub
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "ember"))
    write_llama_gguf(tmp_path / "m-Q8_0.gguf", qtype=None)
    server.add("org/m-GGUF", {"m-Q8_0.gguf": (tmp_path / "m-Q8_0.gguf").read_bytes(), "m-F16.gguf": b"GGUF-other"})
    path = resolve_model("org/m-GGUF:Q8_0")
    assert path.parent == tmp_path / "ember" / "gguf" and (path / "model.safetensors").is_file()
    assert [p.rsplit("/", 1)[1] for p in server.downloads()] == ["m-Q8_0.gguf"]
    rows = {r.name: r for r in catalog.list_models()}
    assert rows["org/m-GGUF"].format == "gguf Q8_0" and rows["org/m-GGUF"].source == "hub"
    assert rows[str(path)].source == "converted" and rows[str(path)].format.startswith("gguf→mlx")
    kind, dirs, _ = catalog.removal("org/m-GGUF:Q8_0")
    assert kind == "hub" and dirs == [path]
    catalog.remove("org/m-GGUF")
    assert not path.exists() and "org/m-GGUF" not in {r.name for r in catalog.list_models()}
    with pytest.raises(hub.HubError, match="ships with Ember"):
        catalog.removal("tiny")


def test_an_unreachable_hub_is_the_not_downloaded_line(fake_hub, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(hub.HubError, match="org/tiny is not downloaded .* the hub cannot be reached"):
        resolve_model("org/tiny")
