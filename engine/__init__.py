"""The floor of Ember: machine parts that know nothing of the actors above.

``engine.kv`` (prompt cache, SSD file format, disk), ``engine.mlx`` (the MLX
backend), ``engine.fake`` (the deterministic fake GPU), ``engine.speculation``
(speculation parts), and the shared vocabulary at this level: ``types``,
``errors``, ``config``, ``ports``. The public API lives one floor up, in
``ember``.
"""
