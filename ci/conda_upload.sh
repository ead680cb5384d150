#!/usr/bin/env bash
# Publish conda packages built by ci/conda_build.sh to this project's channel: the first of stack.toml
# [conda].channels, label [conda].upload_label. Usage:
#   ci/conda_upload.sh [--upload] DIR...
# DIR: directories holding the packages (build/channel, or the workflow's downloaded artifacts), searched recursively.
# First `ucx-dask-gpu conda publishable` refuses the whole upload (exit 63, one line) if any package was built with
# stand-ins, and (exit 61) two files of one name or none: nothing is sent then. Without --upload it is a dry run: it
# prints the anaconda command it would run. With --upload, anaconda-client (on PATH) and ANACONDA_API_TOKEN upload;
# a package already on the channel fails the upload (no --skip-existing: a file is never silently kept or dropped).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
udg=(python3 -m ucx_dask_gpu)

upload=false
if [[ ${1:-} == --upload ]]; then upload=true; shift; fi
(($#)) || { echo "usage: ci/conda_upload.sh [--upload] DIR..." >&2; exit 2; }

packages=$("${udg[@]}" conda publishable "$@")
owner=$("${udg[@]}" stack get conda.channels --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[0])')
label=$("${udg[@]}" stack get conda.upload_label)
mapfile -t files <<<"$packages"
cmd=(anaconda upload --user "$owner" --label "$label" "${files[@]}")
if ! $upload; then
  echo "dry run (ci/conda_upload.sh --upload to publish): ${cmd[*]}"
  exit 0
fi
"${cmd[@]}"
