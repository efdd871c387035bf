#!/usr/bin/env bash
# Runs the whole test suite in .venv. Tests start what they need themselves (redis-server, mooncake_master and
# mooncake_client on free loopback ports, vLLM engines); this script only makes sure the Debian packages they
# need are installed (scripts/system_packages.sh says which and why).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/system_packages.sh
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
