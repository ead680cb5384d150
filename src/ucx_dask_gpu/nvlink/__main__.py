import sys

from ..cliutil import hold_signals_until_run

hold_signals_until_run()
# After the hold: a signal while the command's modules are imported must end as one at any other moment does.
from .cli import main  # noqa: E402

sys.exit(main())
