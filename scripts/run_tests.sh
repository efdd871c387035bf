#!/usr/bin/env bash
# Runs the whole test suite in .venv. Tests start what they need themselves (redis-server on a free
# loopback port, vLLM engines); this script only makes sure redis-server (and curl) is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1 || ! command -v curl >/dev/null 2>&1; then
  echo "[test] installing redis-server and curl (Debian packages; curl: a client of the management API)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server curl >/dev/null
fi
# Everything the tests write under the temp dir (vLLM's caches and sockets, pytest's tmp_path) goes into
# one short-named directory that is removed afterwards.
TMPDIR=$(mktemp -d /tmp/lmv-test-XXXXXX)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
# Lint and types first: seconds with their caches (mypy's first run takes a few minutes), and a
# failure here stops the slow tests. Settings: ruff.toml, mypy.ini.
echo "[test] ruff check"
.venv/bin/python -m ruff check . || exit 1
echo "[test] mypy"
.venv/bin/python -m mypy || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "[test] pytest collected no tests"; exit 1
fi
exit $rc
