"""``--max-kv-size`` / ``--kv-bits`` / ``--kv-group-size`` reach EngineConfig, and
bad values exit 2 naming the parameter (their engine behaviour is in
tests/ember/test_cache_kinds.py)."""

from __future__ import annotations

import pytest

from transport.cli import build_parser, engine_config


def test_kv_flags_map_onto_engine_config():
    args = build_parser().parse_args(
        ["serve", "--fake-gpu", "--max-kv-size", "4096", "--kv-bits", "4", "--kv-group-size", "32"]
    )
    config = engine_config(args, args.parser)
    assert (config.max_kv_size, config.kv_bits, config.kv_group_size) == (4096, 4, 32)
    args = build_parser().parse_args(["generate", "--fake-gpu", "--prompt", "x", "--kv-bits", "8"])
    assert engine_config(args, args.parser).kv_bits == 8


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--kv-bits", "7"], "kv_bits must be one of"),
        (["--kv-group-size", "48"], "kv_group_size must be"),
        (["--max-kv-size", "0"], "max_kv_size must be >= 1"),
    ],
)
def test_bad_kv_flags_exit_2(flags, says, capsys):
    args = build_parser().parse_args(["serve", "--fake-gpu", *flags])
    with pytest.raises(SystemExit) as e:
        engine_config(args, args.parser)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
