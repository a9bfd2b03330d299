"""The ``ember`` command as a user runs it: startup errors exit 2 with one
clear line; ``ember generate --fake-gpu`` prints the completion."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from engine.fake.gpu import expected_tokens
from engine.fake.tokenizer import ByteTokenizer
from engine.mlx.blas import OPT_OUT
from transport.cli import build_parser, engine_config


def ember(*args: str, openblas: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    # The fake GPU needs no BLAS: skip the OpenBLAS re-exec (a second interpreter start).
    env = {**os.environ} if openblas else {**os.environ, OPT_OUT: "1"}
    return subprocess.run([sys.executable, "-m", "transport.cli", *args], capture_output=True, timeout=timeout, env=env)


@pytest.mark.parametrize(
    "args, says",
    [
        (["serve", "--batch", "many"], "invalid int value"),
        (["serve", "--fake-gpu", "--port", "http"], "invalid int value"),
        (
            ["serve", "--fake-gpu", "--prompt-cache", "0", "--ssd-cache", "/tmp/ember-ssd"],
            "the SSD cache needs the RAM tier",
        ),
        (["serve", "--fake-gpu", "--batch", "0"], "max_batch must be >= 1"),
        (["serve", "--fake-gpu", "--min-cached-prefix", "0"], "min_cached_prefix must be >= 1"),
        (["serve", "--model", "/nonexistent/model/dir"], "neither a bundled model"),
        (["serve", "--model", "/tmp", "--draft-model", "/nonexistent/draft"], "neither a bundled model"),
        (["generate", "--fake-gpu"], "--prompt"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_flags_and_combinations_exit_2(args, says, capsys):
    # In-process up to the point where the server would start: parse and validate.
    with pytest.raises(SystemExit) as e:
        parsed = build_parser().parse_args(args)
        engine_config(parsed, parsed.parser)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_bad_flag_exit_code_from_the_command():
    r = ember("serve", "--batch", "many")
    assert r.returncode == 2
    assert b"argument --batch: invalid int value" in r.stderr
    assert b"Traceback" not in r.stderr


@pytest.mark.slow  # subprocess that imports MLX
def test_a_model_directory_that_does_not_load_exits_2(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    r = ember("serve", "--model", str(tmp_path), "--port", "0", "--log-level", "error", openblas=True)
    assert r.returncode == 2
    assert b"ember: error: the engine did not start" in r.stderr
    r = ember("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert r.returncode == 2, r.stderr  # not 134: see transport.cli._import_mlx_on_main_thread
    assert b"ember: error: could not load" in r.stderr


def test_a_busy_port_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = ember("serve", "--fake-gpu", "--port", str(port))
    assert r.returncode == 2
    assert b"cannot listen on 127.0.0.1" in r.stderr


def test_generate_prints_the_completion():
    r = ember("generate", "--fake-gpu", "--prompt", "hello", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    want = ByteTokenizer().decode(expected_tokens(list(b"hello"), 12))
    assert r.stdout.decode("utf-8") == want + "\n"


def test_generate_with_a_bad_request_exits_2():
    r = ember("generate", "--fake-gpu", "--prompt", "hello", "--max-tokens", "0")
    assert r.returncode == 2
    assert b"max_tokens must be at least 1" in r.stderr


def test_serve_flags_map_onto_engine_config(tmp_path):
    args = build_parser().parse_args(
        [
            "serve",
            "--fake-gpu",
            "--batch",
            "16",
            "--max-queue",
            "5",
            "--prompt-cache",
            "0.5",
            "--ssd-cache",
            str(tmp_path),
            "--ssd-cache-max",
            "3",
            "--ssd-cache-verify",
            "--ssd-demote-idle",
            "30",
            "--draft-model",
            "ngram",
            "--num-draft-tokens",
            "4",
            "--served-model-name",
            "mine",
            "--min-cached-prefix",
            "64",
        ]
    )
    config = engine_config(args, args.parser)
    assert (config.backend, config.max_batch, config.max_queue, config.prompt_cache_gib) == ("fake", 16, 5, 0.5)
    assert (config.ssd_cache_dir, config.ssd_cache_max_gib, config.ssd_cache_verify) == (str(tmp_path), 3.0, True)
    assert (config.ssd_demote_idle_s, config.draft_model, config.num_draft_tokens) == (30.0, "ngram", 4)
    assert config.model_name == "mine" and config.min_cached_prefix == 64
    defaults = engine_config(build_parser().parse_args(["serve", "--fake-gpu", "--no-ssd-cache"]), args.parser)
    # unset flags leave EngineConfig's defaults, but for serve's own: the prefill share (#32)
    assert defaults == type(config)(backend="fake", prefill_share=0.5)
