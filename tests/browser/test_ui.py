"""The dashboard and playground page in a real browser: headless Debian
Chromium driven by playwright-core (tests/browser/drive.mjs) against
``ember serve --model tiny`` with an SSD tier, the n-gram drafter and an API
key. ``.ci/run``'s browser stage installs both and runs ``pytest -m browser``;
elsewhere set EMBER_NODE_MODULES to a node_modules folder holding
playwright-core (and EMBER_CHROMIUM if Chromium is not /usr/bin/chromium).
Screenshots of both views go to EMBER_CI_ARTIFACTS (default: the test's tmp dir)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.live_server import ember_serve

pytestmark = [pytest.mark.browser, pytest.mark.slow]

KEY = "browser-test-key"
CHROMIUM = os.environ.get("EMBER_CHROMIUM", "/usr/bin/chromium")
NODE_MODULES = os.environ.get("EMBER_NODE_MODULES", "")


def _need_browser() -> None:
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"chromium ({CHROMIUM})")
    if shutil.which("node") is None:
        missing.append("node")
    if not NODE_MODULES or not (Path(NODE_MODULES) / "playwright-core").is_dir():
        missing.append("playwright-core (EMBER_NODE_MODULES)")
    if missing and os.environ.get("EMBER_BROWSER_REQUIRED"):
        pytest.fail(f"needs {', '.join(missing)} (EMBER_BROWSER_REQUIRED is set)")
    if missing:
        pytest.skip(f"browser stage: needs {', '.join(missing)}; .ci/run's browser stage installs them")


def _browser_env() -> dict[str, str]:
    """The test's environment without what pytest's OpenBLAS re-exec put there:
    node and Chromium must not inherit LD_PRELOAD (their threads fail to start)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("OPENBLAS")}
    return env | {"EMBER_NODE_MODULES": NODE_MODULES, "EMBER_CHROMIUM": CHROMIUM}


def test_page_in_a_browser(tmp_path: Path) -> None:
    _need_browser()
    out = Path(os.environ.get("EMBER_CI_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--model", "tiny", "--ssd-cache", str(tmp_path / "ssd"), "--draft-model", "ngram", "--api-key", KEY]
    with ember_serve(*flags) as (_, url):
        run = subprocess.run(
            ["node", str(Path(__file__).with_name("drive.mjs")), url, KEY, str(out)],
            capture_output=True,
            text=True,
            timeout=240,
            env=_browser_env(),
        )
        assert run.returncode == 0, f"drive.mjs failed:\n{run.stdout}\n{run.stderr}"
        seen = json.loads(run.stdout.strip().splitlines()[-1])
        # the server itself refuses the wrong key too, and what the page showed is the server's
        req = urllib.request.Request(f"{url}/stats", headers={"Authorization": f"Bearer {KEY}-wrong"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        refused.value.close()
        assert refused.value.code == 401
        req = urllib.request.Request(f"{url}/stats", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            stats = json.load(r)

    assert seen["errors_at_load"] == 0, seen
    assert seen["errors_before_wrong_key"] == [], seen  # no console error while the page is used with its key
    assert seen["requests_elsewhere"] == [], seen  # nothing left this origin
    # the picker lists every name the registry can serve (#30), the served model among them
    assert "tiny" in seen["models"], seen
    assert seen["answer"].strip(), seen
    assert len(seen["stream_lengths"]) >= 2, f"the answer did not stream in steps: {seen['stream_lengths']}"
    assert seen["cached_first"] == 0 and seen["cached_replay"] > 0, seen  # the replay hit the prompt cache
    assert "cache hit" in seen["replay_usage"]
    assert seen["served_before"] == "0" and int(seen["served_after"]) >= 2, seen
    assert seen["ttft_bars"] >= 2 and seen["cache_columns"] >= 2, seen
    # a pull /health reports: its repo, bytes done / total and percent (#43)
    assert "org/fake-model" in seen["pull_text"] and "3.0 MiB / 12.0 MiB" in seen["pull_text"], seen
    assert "25%" in seen["pull_text"], seen
    assert "401" in seen["asked_again"], seen  # the refused poll asked for the key again
    assert "401" in seen["refused"], seen
    assert seen["typing_kept"] == ["prompt", "Hello?"], seen  # a refused poll does not take the user's typing
    # the page's figures are the server's: two requests in the ring, the replay mostly from RAM
    recent = stats["recent_requests"]["requests"]
    assert [r["ram_cached_tokens"] > 0 for r in recent[:2]] == [False, True], recent
    for name in ("dashboard.png", "playground.png"):
        assert (out / name).stat().st_size > 10_000, name
