"""``ember serve`` turns the SSD prompt-cache tier on by default (issue #32): a
folder per model under the user's cache dir, a byte cap derived from free space
and stated at start, ``--no-ssd-cache`` to opt out. One function decides it
(``ember.ssd_tier.resolve_ssd``) for serve, launch and the embedded Engine
(issue #44 item 3). The suite itself never writes into the real home
(tests/conftest.py points EMBER_KV_CACHE_DIR at a temp dir)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from ember import Engine, EngineConfig, ssd_tier
from ember.ssd_folders import kv_root, model_key
from engine.cache_dir import cache_root
from engine.mlx import calibration_cache, gguf_convert
from transport.cli import build_parser, engine_config, launch_serve_args
from transport.server.launch import cache_dir as launch_cache_dir
from transport.server.launch import server_args

GIB = 1024**3


def serve_config(*flags: str):
    args = build_parser().parse_args(["serve", "--fake-gpu", *flags])
    return engine_config(args, args.parser), args


def test_serve_turns_the_ssd_tier_on_under_the_kv_root(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_KV_CACHE_DIR", str(tmp_path))
    config, args = serve_config()
    assert config.ssd_cache_dir is not None
    assert os.path.dirname(config.ssd_cache_dir) == str(tmp_path)
    assert os.path.basename(config.ssd_cache_dir).startswith("tiny-")
    assert 0 < config.ssd_cache_max_gib <= ssd_tier.DEFAULT_CAP_GIB
    assert config.ssd_cache_dir in args.ssd_note and f"cap {config.ssd_cache_max_gib:.1f} GiB" in args.ssd_note


def test_opt_out_and_its_neighbours(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_KV_CACHE_DIR", str(tmp_path))
    config, args = serve_config("--no-ssd-cache")
    assert config.ssd_cache_dir is None and args.ssd_note == "SSD prompt cache off"
    config, args = serve_config("--prompt-cache", "0")  # the SSD tier needs the RAM tier: a default is no error
    assert config.ssd_cache_dir is None
    config, args = serve_config("--ssd-cache", str(tmp_path / "mine"))  # an explicit dir keeps the fixed cap
    assert (config.ssd_cache_dir, config.ssd_cache_max_gib) == (str(tmp_path / "mine"), 32.0)
    config, args = serve_config("--ssd-cache-max", "2")
    assert config.ssd_cache_max_gib == 2.0 and config.ssd_cache_dir.startswith(str(tmp_path))
    with pytest.raises(SystemExit):  # both at once is a usage error
        serve_config("--no-ssd-cache", "--ssd-cache", str(tmp_path))
    gen = build_parser().parse_args(["generate", "--fake-gpu", "--prompt", "hi"])
    assert engine_config(gen, gen.parser).ssd_cache_dir is None  # only `serve` persists by default


def test_cache_root_follows_the_environment():
    home = os.path.expanduser("~/.cache")
    assert kv_root({}) == os.path.join(home, "ember", "kv")
    assert kv_root({"XDG_CACHE_HOME": "/x"}) == "/x/ember/kv"
    assert kv_root({"XDG_CACHE_HOME": "/x", "EMBER_CACHE_DIR": "/e"}) == "/e/kv"
    assert kv_root({"EMBER_CACHE_DIR": "/e", "EMBER_KV_CACHE_DIR": "/k"}) == "/k"


def test_the_cap_is_min_of_the_fixed_cap_and_a_tenth_of_free_space():
    def disk(free_gib: float):
        return lambda _path: SimpleNamespace(free=int(free_gib * GIB))

    env = {"EMBER_KV_CACHE_DIR": "/nonexistent/kv"}  # measured at the nearest existing parent
    tiny = EngineConfig(model="tiny")
    assert ssd_tier.default_ssd(tiny, environ=env, disk_usage=disk(1000)).cap_gib == 32.0
    assert ssd_tier.default_ssd(tiny, environ=env, disk_usage=disk(50)).cap_gib == 5.0
    assert ssd_tier.default_ssd(tiny, environ=env, disk_usage=disk(1)) is None  # 0.1 GiB: not worth it


def test_one_folder_per_model_and_kv_layout():
    # the cold store's scan deletes files of another model: they must not share a folder
    keys = {
        model_key("smollm2-135m"),
        model_key("gemma3-270m"),
        model_key("smollm2-135m", kv_bits=8, kv_group_size=64),
        model_key("smollm2-135m", window=512),
        model_key("/models/a/smollm2-135m"),
    }
    assert len(keys) == 5
    assert model_key("smollm2-135m") == model_key("smollm2-135m")


def test_the_suite_does_not_write_into_the_real_home():
    assert os.path.basename(os.environ["EMBER_KV_CACHE_DIR"]).startswith("ember-test-kv-")


def launched_config(*flags: str):
    """The config of the ``ember serve`` that ``ember launch claude FLAGS`` starts."""
    la = build_parser().parse_args(["launch", "claude", *flags])
    args = build_parser().parse_args(["serve", *server_args(launch_serve_args(la), la.host, la.ssd_cache)])
    return engine_config(args, args.parser)


def served_config(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    return engine_config(args, args.parser)


def test_serve_and_launch_resolve_one_folder_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_KV_CACHE_DIR", str(tmp_path))
    served, launched = served_config("--model", "tiny"), launched_config("--model", "tiny")
    assert served.ssd_cache_dir == launched.ssd_cache_dir  # a launched session finds a served one's cache
    assert served.ssd_cache_max_gib == launched.ssd_cache_max_gib  # under the same cap
    assert os.path.dirname(served.ssd_cache_dir) == str(tmp_path)
    other = launched_config("--model", "tiny-draft")  # another model: never the same folder
    assert other.ssd_cache_dir != launched.ssd_cache_dir
    assert os.path.dirname(other.ssd_cache_dir) == str(tmp_path)
    assert served_config("--model", "tiny-draft").ssd_cache_dir == other.ssd_cache_dir
    mine = launched_config("--model", "tiny", "--ssd-cache", str(tmp_path / "mine"))  # asked for: kept
    assert mine.ssd_cache_dir == str(tmp_path / "mine")


def test_ember_cache_dir_moves_everything_ember_writes(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBER_KV_CACHE_DIR")  # the suite's own override of the KV root
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    root = str(tmp_path)
    assert cache_root() == root
    assert served_config("--model", "tiny").ssd_cache_dir.startswith(os.path.join(root, "kv") + os.sep)
    assert launched_config("--model", "tiny").ssd_cache_dir.startswith(os.path.join(root, "kv") + os.sep)
    assert str(gguf_convert.cache_root()) == os.path.join(root, "gguf")
    assert str(calibration_cache.cache_dir()) == os.path.join(root, "cpu")
    assert str(launch_cache_dir()) == root  # launch's client configs


def test_the_embedded_engine_resolves_auto_to_serves_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_KV_CACHE_DIR", str(tmp_path))
    served = served_config("--fake-gpu")
    engine = Engine.start(EngineConfig(backend="fake", ssd_cache_dir="auto"))
    try:
        assert engine.config.ssd_cache_dir == served.ssd_cache_dir
        assert engine.cold_tier is not None  # the tier runs
    finally:
        engine.stop()
    off = Engine.start(EngineConfig(backend="fake"))  # the library's default: nothing written unasked
    try:
        assert off.config.ssd_cache_dir is None and off.cold_tier is None
    finally:
        off.stop()
    # no RAM tier: "auto" is off, not an error (an explicit folder without one is)
    assert ssd_tier.resolve_ssd(EngineConfig(ssd_cache_dir="auto", prompt_cache_gib=0))[0].ssd_cache_dir is None
