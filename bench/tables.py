"""The registry of ``bench.docs``: every benchmark table the README and docs/ cite, with its command.

A table's block lives in ``doc`` between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; its
body is what ``python -m MODULE ARGS`` prints on stdout (Markdown). ``quick`` replaces arguments for
the reduced mode (``python -m bench.docs --quick``: fewer rounds and tokens, minutes in all).
Index with the full commands: docs/bench/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    module: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    model: str
    quick_model: str = ""  # the model the quick arguments load, where it differs

    def argv(self, quick: bool = False) -> list[str]:
        return ["-m", self.module, *(self.quick if quick else self.args)]


TABLES: tuple[Table, ...] = (
    Table(
        name="openblas",
        doc="README.md",
        module="bench.cpu.blas",
        args=("--rounds", "5"),
        quick=("--rounds", "1"),
        model="tiny",
    ),
    Table(
        name="dtype",
        doc="docs/gguf.md",
        module="bench.cpu.dtype",
        args=("--model", "smollm2-135m", "--rounds", "5", "--tokens", "64"),
        quick=("--model", "tiny", "--rounds", "1", "--tokens", "8"),
        model="smollm2-135m",
        quick_model="tiny",
    ),
    Table(
        name="ssd-restore",
        doc="docs/bench/ssd.md",
        module="bench.cache.ssd",
        args=("--prompt-tokens", "8192", "--repeats", "3", "--skip-decode", "--markdown"),
        quick=("--prompt-tokens", "512", "--repeats", "1", "--skip-decode", "--markdown"),
        model="tiny",
    ),
    Table(
        name="verify",
        doc="docs/cold-tier.md",
        module="bench.cache.verify",
        args=("--prompt-tokens", "8192", "--repeats", "5"),
        quick=("--prompt-tokens", "512", "--repeats", "1"),
        model="tiny",
    ),
    Table(
        name="adaptive",
        doc="docs/bench/adaptive.md",
        module="bench.spec.adaptive",
        args=("--rounds", "30"),
        quick=("--rounds", "1", "--tokens", "16", "--prompts", "1", "--workloads", "free"),
        model="tiny + tiny-draft",
    ),
    Table(
        name="models",
        doc="docs/bench/models.md",
        module="bench.models",
        args=(
            "--models",
            "tiny,smollm2-135m",
            "--switch",
            "smollm2-135m,tiny",
            "--rounds",
            "3",
            "--embed-rounds",
            "10",
        ),
        quick=(
            "--models",
            "tiny",
            "--switch",
            "tiny,tiny-draft",
            "--rounds",
            "1",
            "--switch-requests",
            "2",
            "--batches",
            "1,8",
            "--embed-rounds",
            "2",
            "--tokens",
            "8",
        ),
        model="tiny, smollm2-135m, all-minilm-l6-v2 (beside tiny-draft)",
        quick_model="tiny, all-minilm-l6-v2 (beside tiny-draft)",
    ),
)
