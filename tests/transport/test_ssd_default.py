"""``ember serve`` turns the SSD prompt-cache tier on by default (issue #32): a
folder per model under the user's cache dir, a byte cap derived from free space
and stated at start, ``--no-ssd-cache`` to opt out. The suite itself never
writes into the real home (tests/conftest.py points EMBER_KV_CACHE_DIR at a
temp dir)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from transport import ssd_default
from transport.cli import build_parser, engine_config

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
    assert 0 < config.ssd_cache_max_gib <= ssd_default.DEFAULT_CAP_GIB
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
    assert ssd_default.kv_root({}) == os.path.join(home, "ember", "kv")
    assert ssd_default.kv_root({"XDG_CACHE_HOME": "/x"}) == "/x/ember/kv"
    assert ssd_default.kv_root({"XDG_CACHE_HOME": "/x", "EMBER_CACHE_DIR": "/e"}) == "/e/kv"
    assert ssd_default.kv_root({"EMBER_CACHE_DIR": "/e", "EMBER_KV_CACHE_DIR": "/k"}) == "/k"


def test_the_cap_is_min_of_the_fixed_cap_and_a_tenth_of_free_space():
    def disk(free_gib: float):
        return lambda _path: SimpleNamespace(free=int(free_gib * GIB))

    env = {"EMBER_KV_CACHE_DIR": "/nonexistent/kv"}  # measured at the nearest existing parent
    assert ssd_default.default_ssd("tiny", environ=env, disk_usage=disk(1000)).cap_gib == 32.0
    assert ssd_default.default_ssd("tiny", environ=env, disk_usage=disk(50)).cap_gib == 5.0
    assert ssd_default.default_ssd("tiny", environ=env, disk_usage=disk(1)) is None  # 0.1 GiB: not worth it


def test_one_folder_per_model_and_kv_layout():
    # the cold store's scan deletes files of another model: they must not share a folder
    keys = {
        ssd_default.model_key("smollm2-135m"),
        ssd_default.model_key("gemma3-270m"),
        ssd_default.model_key("smollm2-135m", kv_bits=8, kv_group_size=64),
        ssd_default.model_key("smollm2-135m", window=512),
        ssd_default.model_key("/models/a/smollm2-135m"),
    }
    assert len(keys) == 5
    assert ssd_default.model_key("smollm2-135m") == ssd_default.model_key("smollm2-135m")


def test_the_suite_does_not_write_into_the_real_home():
    assert os.path.basename(os.environ["EMBER_KV_CACHE_DIR"]).startswith("ember-test-kv-")
