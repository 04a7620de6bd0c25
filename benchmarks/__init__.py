"""groupcoord's benchmarks, each a script (``python benchmarks/bench_mq.py --quick``);
installed with the package as ``groupcoord_benchmarks`` for ``groupcoord bench``."""
