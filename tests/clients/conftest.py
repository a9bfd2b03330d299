"""The agent CLIs' tests run in their own CI stage (``pytest -m agent_cli``):
a plain ``pytest`` leaves them out unless its ``-m`` names the marker."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if "agent_cli" in (config.option.markexpr or ""):
        return
    keep = [i for i in items if not i.get_closest_marker("agent_cli")]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("agent_cli")])
        items[:] = keep
