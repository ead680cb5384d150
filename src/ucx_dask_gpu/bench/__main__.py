"""`python -m ucx_dask_gpu.bench transpose|svd ...`: the same command as `ucx-dask-gpu bench`, without loading the
CLI's other subcommands (for a GPU host that only carries the benchmark's dependencies)."""
import sys

from ..cli import _Parser
from ..errors import UserError
from . import command


def main(argv=None) -> int:
    parser = _Parser(prog="ucx-dask-gpu", description="Dask on GPUs over UCX: benchmarks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    command.register(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"ucx-dask-gpu bench: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ucx-dask-gpu bench: interrupted", file=sys.stderr)
        return 130


sys.exit(main())
