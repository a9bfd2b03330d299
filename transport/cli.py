"""The ``ember`` command (placeholder until the CLI lands)."""

def main() -> int:
    raise SystemExit("ember: the CLI is not built yet")
