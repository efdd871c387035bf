"""Tests for lmcache_vllm.cpu_affinity and integration.vllm.threads.background_cpus_for: our background threads
run on the CPUs the worker chose for them, never on vLLM's compute cores by accident."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmcache_vllm import cpu_affinity
from lmcache_vllm.cpu_affinity import enter_background_cpus, parse_cpu_list, set_background_cpus

HOST = sorted(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def reset():
    yield
    set_background_cpus(None)


def _affinity_in_thread(initializer=None) -> set[int]:
    seen: list[set[int]] = []
    if initializer is not None:
        with ThreadPoolExecutor(1, initializer=initializer) as pool:
            return pool.submit(lambda: set(os.sched_getaffinity(0))).result()
    t = threading.Thread(target=lambda: (enter_background_cpus(), seen.append(set(os.sched_getaffinity(0)))))
    t.start()
    t.join()
    return seen[0]


def test_cpu_lists_parse_like_vllms():
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0,2-4") == {0, 2, 3, 4}
    assert parse_cpu_list(" 1 , 3 ") == {1, 3}
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2", "99999999"):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_no_set_leaves_threads_where_they_are():
    assert _affinity_in_thread() == set(HOST)


@pytest.mark.skipif(len(HOST) < 2, reason="needs two CPUs")
def test_threads_and_executor_workers_move_the_main_thread_stays():
    set_background_cpus({HOST[-1]})
    assert _affinity_in_thread() == {HOST[-1]}
    assert _affinity_in_thread(enter_background_cpus) == {HOST[-1]}
    assert set(os.sched_getaffinity(0)) == set(HOST)  # the caller's thread is untouched


def test_a_set_the_os_refuses_is_logged_once_and_dropped(caplog):
    set_background_cpus({1 << 15})  # no such CPU
    with caplog.at_level(logging.WARNING, logger="lmcache_vllm.cpu_affinity"):
        assert _affinity_in_thread() == set(HOST)
        assert _affinity_in_thread() == set(HOST)
    assert len([r for r in caplog.records if "background threads stay" in r.message]) == 1
    assert cpu_affinity.background_cpus() is None


def test_storage_threads_run_on_the_background_cpus(tmp_path):
    """The storage loop and the disk tier's readers and writers (the threads that move bytes)."""
    if len(HOST) < 2:
        pytest.skip("needs two CPUs")
    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.storage.manager import StorageManager

    set_background_cpus({HOST[-1]})
    config = LMCacheConfig(max_local_cpu_size=0.01, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)
    with StorageManager(config) as mgr:
        loop_cpus = asyncio.run_coroutine_threadsafe(_current_affinity(), mgr._loop).result(10)
        disk = mgr.lower[0]
        read_cpus = disk._read_pool.submit(lambda: set(os.sched_getaffinity(0))).result()
        write_cpus = disk._write_pool.submit(lambda: set(os.sched_getaffinity(0))).result()
    assert loop_cpus == read_cpus == write_cpus == {HOST[-1]}


async def _current_affinity() -> set[int]:
    return set(os.sched_getaffinity(0))


def test_background_cpus_setting(monkeypatch):
    pytest.importorskip("vllm")
    from lmcache_vllm.integration.vllm.threads import background_cpus_for

    assert background_cpus_for(None, "inherit") is None  # type: ignore[arg-type]
    assert background_cpus_for(None, "3,5-6") == {3, 5, 6}  # type: ignore[arg-type]
    # auto under an explicit binding or none, engine in its own processes (a server): where vLLM put the process
    # (another instance may compute on the cores this one leaves out, its idle workers polling there)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    for binding in ("0", "0|1", "nobind"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", binding)
        assert background_cpus_for(None, "auto") is None  # type: ignore[arg-type]


def test_background_cpus_of_an_in_process_engine_bound_explicitly(monkeypatch):
    """`LLM()` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) bound explicitly: auto takes the host's CPUs
    the binding leaves out, so our saves do not run on the model's core (nothing else of vLLM polls there)."""
    pytest.importorskip("vllm")
    from lmcache_vllm.integration.vllm import threads
    from lmcache_vllm.integration.vllm.threads import background_cpus_for

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(threads, "_host_cpus", lambda: {0, 1, 2, 3})  # the cgroup's cpuset of a 4-CPU host
    for binding, expected in (("0", {1, 2, 3}), ("0|2", {1, 3}), ("1-3", {0}), ("0-3", None), ("nobind", None),
                              ("0,x", None)):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", binding)
        assert background_cpus_for(None, "auto") == expected, binding  # type: ignore[arg-type]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert background_cpus_for(None, "inherit") is None  # type: ignore[arg-type]
    assert background_cpus_for(None, "2") == {2}  # type: ignore[arg-type]


def test_an_in_process_engine_on_a_wider_team_than_its_binding_is_warned_about(monkeypatch, caplog):
    """vLLM 0.32 binds only its multiprocess engine's workers: an in-process engine's OpenMP team may span the
    CPUs our threads were given. The log says so and how to bind it; a team as wide as the binding is quiet."""
    pytest.importorskip("vllm")
    import torch

    from lmcache_vllm.integration.vllm import threads

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(threads, "_host_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    for team, warned in ((2, True), (1, False)):
        monkeypatch.setattr(torch, "get_num_threads", lambda team=team: team)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=threads.__name__):
            assert threads.background_cpus_for(None, "auto") == {1, 2, 3}  # type: ignore[arg-type]
        text = " ".join(r.getMessage() for r in caplog.records)
        assert ("OMP_NUM_THREADS=1 OMP_PLACES='{0}' OMP_PROC_BIND=true" in text) is warned, (team, text)


def test_in_process_jobs_get_the_openmp_binding_a_worker_gets(tmp_path):
    """testing/vllm_jobs: an engine in the job's process gets the OpenMP variables vLLM's multiprocess engine
    gives a worker bound to the same CPUs; a multiprocess job gets none (vLLM sets them for its workers)."""
    from lmcache_vllm.integration.vllm.testing.vllm_jobs import vllm_env

    env = vllm_env(tmp_path / "bound", threads_bind="0-2")
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"], env["OMP_PROC_BIND"]) == ("3", "{0,1,2}", "true")
    for i, kwargs in enumerate(({"multiprocessing": True}, {"threads_bind": "0|1"}, {"threads_bind": "auto"})):
        env = vllm_env(tmp_path / str(i), **kwargs)  # type: ignore[arg-type]
        assert env.get("OMP_PLACES") == os.environ.get("OMP_PLACES"), kwargs
