"""Keeps our background threads off the cores vLLM computes on (`background_cpus_for`); out of OpenMP's way
they are kept by `lmcache_vllm.cpu_affinity.single_threaded_torch`, which the save thread calls first.
"""
from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from lmcache_vllm.cpu_affinity import openmp_binding, parse_cpu_list

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

def _host_cpus() -> set[int]:
    """The CPUs this process may run on before any binding: the cgroup's cpuset, else every online CPU."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            try:
                return set(parse_cpu_list(text))
            except ValueError:
                continue
    return set(os.sched_getaffinity(0))


def background_cpus_for(vllm_config: "VllmConfig", setting: str) -> frozenset[int] | None:
    """Where this worker's background threads should run (`extra_config.background_cpus`): 'inherit' -> None
    (where vLLM put the process); a CPU list -> those CPUs; 'auto' -> the CPUs vLLM's own automatic binding
    (VLLM_CPU_OMP_THREADS_BIND=auto) reserves for the processes beside its compute ranks, connectors included,
    computed by vLLM's `OMPProcessManager`; for an engine in this process (`LLM()` with
    VLLM_ENABLE_V1_MULTIPROCESSING=0) bound explicitly, the host's CPUs its binding leaves out
    (`_beside_in_process_binding`); None when vLLM reserves none, binds nothing (GPU hosts, 'nobind') or a server
    (an engine in its own processes) was bound explicitly. Why not the CPUs a server's explicit binding leaves
    out: another vLLM instance on the host (a prefill beside a decode instance) may compute there, and an idle
    vLLM worker process polls its queue on its cores; our threads there starved (a decode instance's pull took
    0.6-7 s instead of 20 ms, measured)."""
    if setting == "inherit":
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return None
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if binding != "auto":
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip().lower() in ("0", "false")
        return _beside_in_process_binding(binding) if in_process else None
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager
        manager = OMPProcessManager(vllm_config)
    except Exception as exc:  # a vLLM without it, or a binding it cannot compute here: stay where we are
        logger.info("background threads stay on the compute CPUs (%s)", exc)
        return None
    compute = {cpu for cpus in manager.cpu_lists for cpu in cpus}
    return frozenset((set(manager.reserved_cpu_list) & _host_cpus()) - compute) or None


def _beside_in_process_binding(binding: str) -> frozenset[int] | None:
    """The host's CPUs an explicit VLLM_CPU_OMP_THREADS_BIND ("0", "0-3", "0|1": one list per rank) leaves out,
    for an engine living in this process. Such an engine has no worker process polling a queue (it computes only
    inside `generate`), so the cores it leaves free are the right place for our saves; on the model's core they
    took its time (bench_e2e_ttft: a cold request with the connector ran at 0.96 of the speed without it, the
    saves there taking 121 ms per batch). None when nothing is left, or for a binding that is not a CPU list."""
    try:
        compute: set[int] = set()
        for part in binding.split("|"):
            compute |= parse_cpu_list(part)
    except ValueError:
        return None
    beside = frozenset(_host_cpus() - compute) or None
    _warn_unbound_team(binding, compute, beside)
    return beside


def _warn_unbound_team(binding: str, compute: set[int], beside: frozenset[int] | None) -> None:
    """vLLM 0.32 applies VLLM_CPU_OMP_THREADS_BIND only to the worker processes of its multiprocess engine (as
    OpenMP variables set before starting them); an engine in this process computes on an OpenMP team as wide
    as torch's default, over CPUs the binding left to our threads. Measured on 2 cores: our saves then cost
    the model more time than their own CPU time. Called from the thread the engine computes on."""
    import torch

    team = torch.get_num_threads()
    if team > len(compute):
        logger.warning("vLLM's engine in this process computes on %d OpenMP threads, but "
                       "VLLM_CPU_OMP_THREADS_BIND=%s names %d CPU(s): vLLM applies that binding only to the "
                       "workers of its multiprocess engine. Our background threads (CPUs %s) share cores with "
                       "the model's. To bind this engine as vLLM binds a worker, start Python with %s", team,
                       binding, len(compute), sorted(beside) if beside else "none",
                       " ".join(f"{name}={shlex.quote(value)}" for name, value in openmp_binding(compute).items()))
