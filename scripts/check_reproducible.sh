#!/usr/bin/env bash
# Reproducible from any checkout? Two clones of this checkout's commit at different paths, built under another umask,
# locale and time zone with nothing cached, must give byte-identical UCX prefixes (a normal-form tar of each), UCXX
# wheels and image ids; on a mismatch it names the first differing file (and diffoscope's report where Debian's
# diffoscope is installed), exit 30. docs/reproducibility.md says what is varied and what is held fixed.
# Thin wrapper around `python -m tools.repro_check` (the workshop's check: it needs this checkout, tools/README.md);
# arguments are passed on, e.g.
#   scripts/check_reproducible.sh --clone-dir /tmp/repro-a --clone-dir /tmp/some/deeper/path/repro-b --json r.json
#   scripts/check_reproducible.sh --against-checkout --first ucx-dask-gpu:0.1.0 --fresh-bases   # what CI runs
#   scripts/check_reproducible.sh --no-image                                                   # prefix + wheels
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
if [ ! -x "$py" ]; then
  echo "check_reproducible.sh: no .venv here; run \`make venv\` first" >&2
  exit 2
fi
exec "$py" -m tools.repro_check "$@"
