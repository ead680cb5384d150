#!/usr/bin/env bash
# Make sure a Docker engine answers. Build machines are fresh Debian 12 hosts (root, no systemd) with a docker client
# but no engine: those of stack.toml [debian].image_host_packages that are missing (Debian's docker.io, debootstrap,
# openssl, skopeo) are installed, and dockerd is started in the background (overlay2 works as root). Without an
# engine and unable to start one: one line, exit 7.
# The logic is tools/docker_engine.py; `--no-start` only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
  exec .venv/bin/python -m tools.docker_engine "$@"
fi
# Before `make venv`: the engine check needs only the standard library.
PYTHONPATH=.:src exec python3 -m tools.docker_engine "$@"
