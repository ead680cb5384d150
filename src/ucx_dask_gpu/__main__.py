"""`ucx-dask-gpu` (the console script: `main` from here) and `python -m ucx_dask_gpu`."""
import sys

from .cliutil import hold_signals_until_run


def main() -> int:
    # Held in main, not at import: multiprocessing's spawn imports the console script again in every worker process a
    # local cluster starts, and those must keep SIGTERM's default. The commands are imported after the hold: that
    # takes a few tenths of a second (more on a busy host), and a signal then must end as one at any other moment.
    hold_signals_until_run()
    from .cli import main as run_command_line
    return run_command_line()


if __name__ == "__main__":
    sys.exit(main())
