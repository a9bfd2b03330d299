"""The floor of Ember: machine parts that know nothing of the actors above.

``engine.kv`` (prompt cache, SSD file format, disk), ``engine.speculation``
(speculation parts), and the shared vocabulary at this level: ``types``,
``errors``, ``config``, ``ports``; on them two wings that none of those import
(the engine-wings contract): ``engine.mlx`` (the MLX backend) and
``engine.fake`` (the deterministic fake GPU, its drafter, the faulty disk).
The public API lives one floor up, in ``ember``.
"""
