#!/usr/bin/env bash
# Installs the Debian packages the tests and benchmarks need, if missing: redis-server (real Redis servers on
# loopback); libibverbs1, which Mooncake's library loads even for TCP (LMCache 0.5.6 imports it too: its
# server mode, the benchmarks' peer, does not start without it); libssl-dev, with which SGLang compiles its
# page hash (OpenSSL SHA-256) on first use (tests/test_sglang_*.py); curl, a client of the management API
# nobody here wrote (tests/e2e/test_management.py). Idempotent: nothing runs when all are there.
set -uo pipefail
PACKAGES=""
command -v redis-server >/dev/null 2>&1 || PACKAGES="$PACKAGES redis-server"
/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || PACKAGES="$PACKAGES libibverbs1"
[ -e /usr/include/openssl/sha.h ] || PACKAGES="$PACKAGES libssl-dev"
command -v curl >/dev/null 2>&1 || PACKAGES="$PACKAGES curl"
if [ -n "$PACKAGES" ]; then
  echo "[packages] installing$PACKAGES (Debian packages)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  # shellcheck disable=SC2086
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $PACKAGES >/dev/null
fi
