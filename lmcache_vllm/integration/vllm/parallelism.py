"""Which parallel layouts the connector serves, where each rank answers lookups, and how TP ranks agree
on failed loads.

- Tensor parallelism: supported; each rank stores its own shard under its own key (`tp<size>.<rank>`).
- Pipeline parallelism: keys (`pp<size>.<rank>`) and lookup sockets (one per (pp, tp) rank, the client
  asks all) carry the stage, but PP > 1 is refused at start-up: vLLM 0.32's CPU backend cannot run it
  (stage 1 fails in `sync_and_gather_intermediate_tensors` without any connector), so that path has
  never run here, and a failed load on one stage would need an agreement across stages that runs in a
  pipeline (see `TPFailureAgreement`).
- Decode / prefill context parallelism (DCP, PCP > 1) shard the KV of one request across ranks by
  token position; our chunks hold whole token ranges: refused at start-up.

`TPFailureAgreement`: a load failure on any TP rank must stop every rank from saving that request in
that step, because the forward all-reduces activations across ranks: KV computed on a healthy rank on
top of another rank's hole is wrong too, and once stored, the "already present" check would keep it. The
worker calls it once per step that has loads and saves: one all-reduce (MAX) of a byte per load, in the
metadata's load order (identical on every rank), over vLLM's TP CPU group (gloo).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_vllm.integration.vllm.lookup import lookup_socket_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class UnsupportedParallelism(ValueError):
    """A parallel layout the connector refuses at start-up (it would not run right)."""


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place: tensor- and pipeline-parallel size and rank."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    def lookup_addresses(self, instance_id: str) -> list[str]:
        """Every (pp, tp) rank's lookup address: a prefix is usable only if all of them hold it."""
        return [lookup_socket_path(instance_id, tp, pp_rank=pp)
                for pp in range(self.pp_size) for tp in range(self.tp_size)]

    def lookup_address(self, instance_id: str) -> str:
        return lookup_socket_path(instance_id, self.tp_rank, pp_rank=self.pp_rank)


def check_supported(vllm_config: "VllmConfig") -> ParallelLayout:
    """The sizes of vLLM's layout (ranks 0), or `UnsupportedParallelism` listing every problem."""
    parallel = vllm_config.parallel_config
    sizes = {
        "pipeline_parallel_size": (parallel.pipeline_parallel_size,
                                   "vLLM's CPU backend cannot run PP here, so it is untested with the connector"),
        "decode_context_parallel_size": (getattr(parallel, "decode_context_parallel_size", 1),
                                         "a request's KV is sharded by position; stored chunks hold whole ranges"),
        "prefill_context_parallel_size": (getattr(parallel, "prefill_context_parallel_size", 1),
                                          "a request's KV is sharded by position; stored chunks hold whole ranges"),
    }
    problems = [f"{name}={value} ({why})" for name, (value, why) in sizes.items() if value != 1]
    if problems:
        raise UnsupportedParallelism("LMCacheConnector does not support " + "; ".join(problems)
                                     + ". Run with these sizes at 1 (tensor parallelism is supported).")
    return ParallelLayout(tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size)


def worker_layout(vllm_config: "VllmConfig") -> ParallelLayout:
    """This worker's ranks (after vLLM initialised its process groups)."""
    layout = check_supported(vllm_config)
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp_rank = get_tensor_model_parallel_rank() if layout.tp_size > 1 else 0
    pp_rank = get_pp_group().rank_in_group if layout.pp_size > 1 else 0
    return ParallelLayout(layout.tp_size, layout.pp_size, tp_rank, pp_rank)


class TPFailureAgreement:
    """`agree(flags) -> flags`: per load, True when it failed on ANY tensor-parallel rank."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size

    def __call__(self, failed: list[bool]) -> list[bool]:
        if self.tp_size <= 1 or not failed:
            return list(failed)
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flags = torch.tensor([1 if f else 0 for f in failed], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return [bool(v) for v in flags.tolist()]
