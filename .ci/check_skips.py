"""Fail on a skip whose reason .ci/allowed-skips does not allow.

    python .ci/check_skips.py SKIPS.jsonl [ALLOWED]

SKIPS.jsonl is what tests/conftest.py writes when EMBER_SKIP_LOG names a file
(one {"nodeid", "reason"} object a line, one per skipped test or module).
Prints every skip with its verdict; exits 1 if any is not allowed.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent


def allowed_patterns(path: pathlib.Path) -> list[re.Pattern[str]]:
    lines = (ln.strip() for ln in path.read_text().splitlines())
    return [re.compile(ln) for ln in lines if ln and not ln.startswith("#")]


def unexplained(skips: list[dict[str, str]], patterns: list[re.Pattern[str]]) -> list[dict[str, str]]:
    return [s for s in skips if not any(p.search(s["reason"]) for p in patterns)]


def main(argv: list[str]) -> int:
    log = pathlib.Path(argv[1])
    allowed = pathlib.Path(argv[2]) if len(argv) > 2 else HERE / "allowed-skips"
    skips = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []
    bad = unexplained(skips, allowed_patterns(allowed))
    for s in skips:
        print(f"[ci] {'NOT ALLOWED' if s in bad else 'allowed'}: {s['nodeid']}: {s['reason']}")
    print(f"[ci] {len(skips)} skip(s), {len(bad)} not in {allowed.name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
