"""`ucx-dask-gpu` (the console script: `main` from here) and `python -m ucx_dask_gpu`."""
import sys

from .cliutil import hold_signals_until_run

hold_signals_until_run()
# After the hold: importing every command's module takes a few tenths of a second (more on a busy host), and a signal
# then must end as one at any other moment does.
from .cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
