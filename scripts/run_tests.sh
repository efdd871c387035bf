#!/usr/bin/env bash
# Runs the whole test suite in .venv. Tests start what they need themselves (redis-server, mooncake_master and
# mooncake_client on free loopback ports, vLLM engines); this script only makes sure the Debian packages they
# need are installed: redis-server; libibverbs1, which Mooncake's library loads even for TCP; libssl-dev, with
# which SGLang compiles its page hash (OpenSSL SHA-256) on first use (tests/test_sglang_*.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PACKAGES=""
command -v redis-server >/dev/null 2>&1 || PACKAGES="$PACKAGES redis-server"
/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || PACKAGES="$PACKAGES libibverbs1"
[ -e /usr/include/openssl/sha.h ] || PACKAGES="$PACKAGES libssl-dev"
if [ -n "$PACKAGES" ]; then
  echo "[test] installing$PACKAGES (Debian packages)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  # shellcheck disable=SC2086
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $PACKAGES >/dev/null
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
