"""Every graceful SIGTERM of `ember serve` on the bundled model exits 0
(issue #23 item 6: 4 of 71 ended in SIGABRT, "terminate called without an
active exception"). 25 shutdowns, 2 at a time, each after serving a request
with the SSD tier on (`sims.live.shutdowns`, which also runs them under gdb)."""

from __future__ import annotations

import argparse
import concurrent.futures

import pytest

from sims.live.shutdowns import one


@pytest.mark.slow
@pytest.mark.stress
def test_25_graceful_shutdowns_of_the_bundled_model_all_exit_0():
    from engine.models import resolve_model

    resolve_model("tiny")
    args = argparse.Namespace(model="tiny", ssd=True, requests=1, start_timeout=180.0, gdb=False)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: one(i, args), range(25)))
    bad = [(i, rc, tail[-1500:]) for i, rc, tail in results if rc != 0]
    assert not bad, f"{len(bad)} of 25 did not exit 0: {bad}"
