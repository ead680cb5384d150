# Sourced by bench_session.sh and control_path_session.sh once their options are read ($out, $start and $budget set):
# `session_open SCRIPT WHAT` refuses a missing OUTDIR (exit 2), copies everything the session prints into
# OUTDIR/session.txt and says what runs where; `left` is the seconds of the budget left.
session_open() {
  [ -n "$out" ] || { echo "$1: no OUTDIR and no \$OUT (see --help)" >&2; exit 2; }
  mkdir -p "$out"
  exec > >(tee -a "$out/session.txt") 2>&1
  echo "== $(date -u +%FT%TZ) $2 session on $(hostname), budget ${budget} s"
}
left() { echo $(( start + budget - $(date +%s) )); }
