"""`python -m ucx_dask_gpu.bench transpose|svd ...`: the same command as `ucx-dask-gpu bench`, without loading the
CLI's other subcommands (for a GPU host that only carries the benchmark's dependencies)."""
import sys

from ..cliutil import standalone_main
from . import cli

sys.exit(standalone_main("bench", cli.register, description="Dask on GPUs over UCX: benchmarks"))
