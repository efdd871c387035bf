"""End to end across vLLM instances through a real 3-node Redis Cluster, and a node SIGKILLed mid-run.

- `writer` (process A): host memory + the cluster; answers LONG (2 chunks), A0..A3 and B0..B7 (one chunk
  each), one prompt per phase, which stores every whole chunk in the cluster: the keys spread over >= 2
  nodes (no hash tags).
- `reader` (process B, fresh, another PYTHONHASHSEED, empty host memory): LONG and A0..A3 come from the
  cluster. Then it pauses; the test SIGKILLs a node that holds some (not all) of the B chunks; B0..B7 then
  run: those on live nodes are hits, those on the dead node are counted misses and recomputed, and the run
  finishes with every output token what vLLM without the connector gives at the same prefill split.
The reference replays both processes' phases in one vLLM without the connector, with its prefix cache.
"""
from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest
from redis.crc import key_slot
from redis_servers import ClusterProcesses

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

LONG = h.random_tokens(80, 600)  # 600 % 256 and 599 % 128 agree: vLLM's prefix cache serves 512 too
A = [h.random_tokens(81 + i, 300) for i in range(4)]  # one whole chunk each
B = [h.random_tokens(90 + i, 300) for i in range(8)]
PREFIX = f"e2e-cluster-{uuid.uuid4().hex[:8]}:"


def phases(items: list[tuple[str, list[int]]]) -> list[dict[str, Any]]:
    return [{"name": name, "prompts": [tokens]} for name, tokens in items]


WRITER_PHASES = phases([("long", LONG), *((f"a{i}", t) for i, t in enumerate(A)),
                        *((f"b{i}", t) for i, t in enumerate(B))])


def reader_phases(go_file: str) -> list[dict[str, Any]]:
    out = phases([("long", LONG), *((f"a{i}", t) for i, t in enumerate(A)), *((f"b{i}", t) for i, t in enumerate(B))])
    out[1 + len(A)]["wait_for_file"] = go_file  # before b0: the test kills a node
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_cluster")


@pytest.fixture(scope="module")
def cluster(work):
    deployment = ClusterProcesses(work / "cluster")
    try:
        yield deployment.start()
    finally:
        deployment.stop()


def job(model: str, config: dict[str, Any] | None, job_phases: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "llm_kwargs": h.llm_kwargs(), "phases": job_phases,
            "kv_transfer_config": h.connector(config) if config is not None else None}


@pytest.fixture(scope="module")
def config(cluster) -> dict[str, Any]:
    return {"remote_url": cluster.url, "max_local_cpu_size": 0.25,
            "extra_config": {"remote_key_prefix": PREFIX}}


@pytest.fixture(scope="module")
def reference(tiny_model, work):
    go = str(work / "reference-go")
    return h.run_job(work, "reference", h.replay(("writer", job(tiny_model, None, WRITER_PHASES)),
                                                 ("reader", job(tiny_model, None, reader_phases(go)))))


@pytest.fixture(scope="module")
def writer(tiny_model, work, config):
    return h.run_job(work, "writer", job(tiny_model, config, WRITER_PHASES), hash_seed=1)


def chunk_node(cluster, slot_map, tokens: list[int], chunk: int = 0) -> int:
    """The port of the node holding whole chunk `chunk` of `tokens`."""
    stored = []
    for node in cluster.nodes:
        client = node.client()
        try:
            stored += [k.decode()[len(PREFIX):] for k in client.scan_iter(match=PREFIX + "*")]
        finally:
            client.close()
    slot = key_slot((PREFIX + h.chunk_keys(stored, tokens)[chunk]).encode())
    return next(port for first, last, port in slot_map if first <= slot <= last)


@pytest.fixture(scope="module")
def reader(tiny_model, work, cluster, config, writer):
    slot_map = cluster.wait_agreed()
    b_nodes = [chunk_node(cluster, slot_map, tokens) for tokens in B]
    counts = {port: b_nodes.count(port) for port in set(b_nodes)}
    victim_port = max((p for p in counts if counts[p] < len(B)), key=lambda p: counts[p], default=None)
    assert victim_port is not None, f"every B chunk is on one node: {b_nodes}"
    go = work / "reader-go"
    result: dict[str, Any] = {}
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.update(h.run_job(work, "reader", job(tiny_model, config, reader_phases(str(go))), hash_seed=2))
        except BaseException as exc:  # reported below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 900
    while not Path(str(go) + ".ready").exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    cluster.node_of_port(victim_port).kill()  # mid-run: after the A phases, before the B phases
    go.write_text("")
    thread.join(900)
    assert not failure, failure
    result["victim"] = f"127.0.0.1:{victim_port}"
    result["on_victim"] = [port == victim_port for port in b_nodes]
    result["keys_per_node_before"] = counts
    return result


def like_reference(result: dict, reference: dict, run: str, name: str) -> None:
    h.assert_like_with_like(h.phase(result, name)[0], h.phase(reference, f"{run}/{name}")[0],
                            h.phase(reference, f"writer/{name}")[0], what=f"{run}/{name}")


def test_writer_spreads_chunks_over_nodes(writer, reference, cluster):
    for name in ["long", *(f"a{i}" for i in range(len(A))), *(f"b{i}" for i in range(len(B)))]:
        like_reference(writer, reference, "writer", name)
    per_node = cluster.keys_per_node(PREFIX + "*")
    assert sum(per_node.values()) == 2 + len(A) + len(B)
    assert sum(1 for n in per_node.values() if n) >= 2, per_node
    stats = writer["stats"]
    assert sum(1 for k, v in stats.items() if k.startswith("redis_node_stored_chunks.") and v) >= 2, stats


def test_fresh_process_loads_through_the_cluster(reader, reference):
    assert h.phase(reader, "long")[0]["num_cached_tokens"] == 512
    like_reference(reader, reference, "reader", "long")
    for i in range(len(A)):
        assert h.phase(reader, f"a{i}")[0]["num_cached_tokens"] == 256
        like_reference(reader, reference, "reader", f"a{i}")
    stats = reader["stats"]
    served = {k: v for k, v in stats.items() if k.startswith("redis_node_read_chunks.") and v}
    assert len(served) >= 2, stats  # loads came from several nodes


def test_node_killed_mid_run_gives_counted_misses_and_unchanged_output(reader, reference):
    for i, on_victim in enumerate(reader["on_victim"]):
        got = h.phase(reader, f"b{i}")[0]
        assert got["num_cached_tokens"] == (0 if on_victim else 256), (i, on_victim)
        like_reference(reader, reference, "reader", f"b{i}")
    stats = reader["stats"]
    missed = sum(reader["on_victim"])
    victim = reader["victim"]
    # each lookup of a chunk on the dead node failed (or was refused at once by its breaker): counted
    assert stats.get(f"redis_node_failed_calls.{victim}", 0) >= 1, stats
    assert stats.get(f"redis_node_failed_calls.{victim}", 0) + \
        stats.get(f"redis_node_skipped_calls.{victim}", 0) >= missed, stats
    assert stats.get("failed_reads.redis", 0) >= missed
    assert stats.get(f"redis_node_breaker_open.{victim}") == 1
