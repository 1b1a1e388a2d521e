"""fmha's benchmarks (``python -m fmha.bench``; ``--help`` lists the modes): one submodule per
mode (suite, latency, e2e, decode, distributed, sparse, kvquant, cuda), the command line in
cli.py, and in _host.py what every result records (command, commit, versions, host, host
class) and where --save puts it (benchmarks/results/<host class>.json)."""

from ._host import cpu_model, host_class
from .cli import main

__all__ = ["cpu_model", "host_class", "main"]
