"""`ucx-dask-gpu` (the console script) and `python -m ucx_dask_gpu`."""
import sys

from .cliutil import hold_signals_until_run


def main() -> int:
    hold_signals_until_run()
    # Imported after the hold: importing every command's module takes a few tenths of a second, and a signal then
    # must end as one at any other moment does.
    from .cli import main as run_command_line
    return run_command_line()


if __name__ == "__main__":
    sys.exit(main())
