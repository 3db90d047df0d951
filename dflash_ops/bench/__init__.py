"""Benchmarks of dflash_ops: the timing harness and the suites behind ``dflash-ops bench``.

``main(argv)`` is the CLI; ``time_fn``, ``rotating``, ``measure_floors``, ``floor_us``,
``host_overhead_us`` and ``Results`` are the harness for writing a suite (see ``bench.norm``: a
module with ``run(quick, **options)`` and, for its own options, ``add_options(parser)``);
``bench.columns`` the checked-then-timed columns and tables the suites share.
"""
from .harness import (  # noqa: F401
    SUITES, Results, env_info, floor_us, host_overhead_us, main, measure_floors, rotating,
    time_fn,
)
