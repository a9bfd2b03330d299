"""Live checks: real ``ember serve`` processes driven over HTTP (crash test,
load check, memory soak, graceful-shutdown counts, trace replay, replicas
behind the gateway), unlike the virtual-time simulation in ``sims/``. Each
starts its servers through ``sims.live.server``."""
