"""Disaggregated prefill in the connector's halves: the params (`pd/params.py`), the scheduler half on vLLM's
real Request / SchedulerOutput objects (holds, params, pulls, refusals and releases), and a prefill worker and
a decode worker in this process on real engines and sockets: the decode worker's paged cache ends up with
the prefill worker's KV, bit for bit, or with load errors for what could not be pulled."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from test_async_loads import finish_async, slots  # noqa: E402
from test_engine import BLOCK, CHUNK, kv_of, make_caches, make_engine, worker_config  # noqa: E402
from test_integration_scheduler import PrefixStore, cached_step, new_step, vllm_blocks  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.integration.vllm.events import HoldReport  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, PeerHoldSpec, PeerSpec, SaveSpec  # noqa: E402
from lmcache_vllm.integration.vllm.pd.params import PDRefusal, check_compatible, parse_remote_prefill, prefill_params  # noqa: E402
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler  # noqa: E402
from lmcache_vllm.integration.vllm.pd.trust import PeerTrust  # noqa: E402
from lmcache_vllm.integration.vllm.pd.worker import PeerTransfer  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.integration.vllm.worker import WorkerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402

S_CHUNK, S_BLOCK = 256, 128
LISTED = "127.0.0.1:7000-7003"  # the prefill instance of `remote_params` (loopback is nobody's by default)
TOY_PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def remote_params(tp: int = 1, chunk: int = S_CHUNK, num_tokens: int = 700) -> dict:
    return prefill_params(engine_id="P", req_id="p-req", host="127.0.0.1", ports=[7000 + r for r in range(tp)],
                          num_tokens=num_tokens, chunk_size=chunk)


# ---------------------------------------------------------------- params
def test_params_round_trip_and_refuse_what_cannot_be_pulled():
    params = remote_params(tp=2)
    remote = parse_remote_prefill(params)
    assert (remote.req_id, remote.host, remote.ports, remote.tp_size, remote.num_tokens) == \
        ("p-req", "127.0.0.1", (7000, 7001), 2, 700)
    assert params["remote_port"] == 7000 and params["do_remote_prefill"] and not params["do_remote_decode"]
    check_compatible(remote, tp_size=2, chunk_size=S_CHUNK)
    with pytest.raises(PDRefusal, match="tensor_parallel_size=2") as refused:
        check_compatible(remote, tp_size=1, chunk_size=S_CHUNK)
    assert refused.value.reason == "tp_mismatch"
    with pytest.raises(PDRefusal, match="chunk_size"):
        check_compatible(remote, tp_size=2, chunk_size=128)
    nixl = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "h",
            "remote_port": 5600, "tp_size": 1, "remote_request_id": "r"}
    for bad in (nixl, dict(params, lmcache_vllm={"version": 99}), dict(params, tp_size=3),
                dict(params, lmcache_vllm=dict(params["lmcache_vllm"], ports=[0, 70000])),
                dict(params, remote_host="")):
        with pytest.raises(PDRefusal) as refused:
            parse_remote_prefill(bad)
        assert refused.value.reason == "bad_params"


# ---------------------------------------------------------------- scheduler half
def make_half(*, can_load=True, can_save=True, tp=1, ports=(9000,)):
    """A scheduler half with PD configured explicitly: `pd_peers` lists the prefill instance of `remote_params`."""
    store = PrefixStore(0)
    pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=tp, ask_ports=lambda: list(ports),
                     can_load=can_load, can_save=can_save, trust=PeerTrust([LISTED]), hold_for_any_client=True)
    half = SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK), block_size=S_BLOCK, lookup_client=store,
                         can_load=can_load, can_save=can_save, pd=pd)
    return half, store


def pd_request(req_id: str, n: int, params: dict | None) -> Request:
    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    return Request(req_id, list(range(100, 100 + n)), SamplingParams(max_tokens=1, extra_args=extra), None)


def finish(half, req, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    req.status = status
    return half.request_finished(req, [])


def test_prefill_side_saves_the_whole_prompt_holds_it_and_answers_with_its_address():
    half, _ = make_half(ports=(9000, 9001))
    req = pd_request("a", 700, TOY_PROXY_PREFILL)
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # its own cache: nothing stored
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    meta = half.build_connector_meta(new_step(req, list(range(6)), computed=0, scheduled=700))
    (save,) = meta.saves
    assert save.num_tokens == 700 and save.for_peer and save.is_last  # the partial chunk too
    (hold,) = meta.peer_holds
    assert hold.req_id == "a" and len(hold.token_ids) == 700
    delay_free, params = finish(half, req)
    assert delay_free  # only while its save copies out of vLLM's blocks
    remote = parse_remote_prefill(params)
    assert (remote.host, remote.ports, remote.req_id, remote.num_tokens, remote.tp_size) == \
        ("10.0.0.1", (9000, 9001), "a", 700, 2)
    assert params["remote_engine_id"] == "E" and metrics.value("pd_prefill_requests") == 1


def test_prefill_hold_goes_out_in_the_step_that_completes_the_prompt_and_an_abort_drops_it():
    half, _ = make_half()
    req = pd_request("a", 700, TOY_PROXY_PREFILL)
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    meta = half.build_connector_meta(new_step(req, list(range(6)), computed=0, scheduled=512))
    assert meta.peer_holds == [] and [s.num_tokens for s in meta.saves] == [512]
    meta = half.build_connector_meta(cached_step(req, None, computed=512, scheduled=188))
    assert [h.req_id for h in meta.peer_holds] == ["a"] and [s.num_tokens for s in meta.saves] == [700]
    assert finish(half, req, RequestStatus.FINISHED_ABORTED)[1] is None
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_unholds == ["a"]


def prompt_done(half, req):
    """Schedules `req`'s whole prompt in one step and finishes it: the holds that went out, and its params."""
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    holds = [h.req_id for h in half.build_connector_meta(new_step(req, list(range(6)), 0, 700)).peer_holds]
    return holds, finish(half, req)[1]


def test_prefill_answers_without_params_when_the_held_kv_would_pass_the_workers_cap(caplog):
    """The workers report their cap on held KV (extra_config.pd_max_held_bytes, in tokens) and which holds
    ended; a request whose hold would pass it is not held and answered without params (its decode instance
    recomputes without a pull); an ended hold makes room again."""
    half, _ = make_half()
    holds, params = prompt_done(half, pd_request("a", 700, TOY_PROXY_PREFILL))
    assert holds == ["a"] and params is not None  # no cap heard yet
    half.pd.heard(HoldReport([], cap_tokens=1500))
    holds, params = prompt_done(half, pd_request("b", 700, TOY_PROXY_PREFILL))
    assert holds == ["b"] and params is not None  # 1400 held
    holds, params = prompt_done(half, pd_request("c", 700, TOY_PROXY_PREFILL))
    assert holds == [] and params is None  # 2100 > 1500
    assert metrics.value("pd_holds_refused") == 1 and "pd_max_held_bytes" in caplog.text
    half.pd.heard(HoldReport(["a"], cap_tokens=1500))  # a released by its decode instance
    holds, params = prompt_done(half, pd_request("d", 700, TOY_PROXY_PREFILL))
    assert holds == ["d"] and params is not None
    half.pd.heard(HoldReport([], cap_tokens=0))  # no cap
    assert prompt_done(half, pd_request("e", 700, TOY_PROXY_PREFILL))[1] is not None
    assert metrics.value("pd_holds_refused") == 1


def test_a_request_without_params_or_on_a_consumer_holds_nothing():
    half, _ = make_half()
    plain = pd_request("a", 700, None)
    half.update_state_after_alloc(plain, vllm_blocks(list(range(6))), 0)
    meta = half.build_connector_meta(new_step(plain, list(range(6)), computed=0, scheduled=700))
    assert meta.peer_holds == [] and [s.num_tokens for s in meta.saves] == [512]
    consumer, _ = make_half(can_save=False)
    req = pd_request("b", 700, TOY_PROXY_PREFILL)
    consumer.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    assert consumer.build_connector_meta(new_step(req, list(range(6)), 0, 700)).peer_holds == []
    assert finish(consumer, req) == (False, None)


def test_decode_side_pulls_asynchronously_without_a_lookup():
    half, store = make_half()
    req = pd_request("d", 700, remote_params())
    assert half.get_num_new_matched_tokens(req, 128) == (572, True)  # all but vLLM's own hit
    assert half.get_num_new_matched_tokens(req, 128) == (572, True)  # asked again while waiting for blocks
    assert store.calls == 0
    blocks = list(range(10, 16))
    half.update_state_after_alloc(req, vllm_blocks(blocks), 572)
    assert half.hit_sources("d") == {"peer": 572}
    meta = half.build_connector_meta(SchedulerOutput.make_empty())
    (load,) = meta.loads
    assert load.is_async and load.peer == PeerSpec("p-req", "127.0.0.1", (7000,), LISTED)
    assert (load.skip_leading, load.load_end, len(load.token_ids), load.block_ids) == (128, 700, 700, blocks)
    assert meta.peer_releases == []  # the pull releases the hold itself
    assert finish(half, req, RequestStatus.FINISHED_STOPPED) == (False, None)
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases == []


@pytest.mark.parametrize("case", ["tp_mismatch", "aborted_first", "nothing_to_pull", "never_seen", "role"])
def test_decode_side_tells_the_prefill_instance_whenever_it_will_not_pull(case, caplog):
    """An admitted prefill instance of this TP and chunk size hears at once that D will not pull (RELEASE);
    one of another TP size hears nothing (issue 39 #3: its ports are not ranks D shares, and a client could
    name 256 of them)."""
    half, store = make_half(tp=2 if case == "tp_mismatch" else 1, can_load=case != "role")
    req = pd_request("d", 700, remote_params())
    if case in ("tp_mismatch", "role"):
        with caplog.at_level("WARNING"):
            half.update_state_after_alloc(req, vllm_blocks([]), 0)
            if case == "tp_mismatch":
                assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # its own cache: no hit
        assert metrics.value("pd_pull_failures", reason=case) == 1
        assert ("tensor_parallel_size=1, this decode instance 2" if case == "tp_mismatch" else "kv_producer") \
            in caplog.text
    elif case == "aborted_first":
        assert half.get_num_new_matched_tokens(req, 0) == (700, True)
        finish(half, req, RequestStatus.FINISHED_ABORTED)
    elif case == "nothing_to_pull":
        assert half.get_num_new_matched_tokens(req, 0) == (700, True)
        half.update_state_after_alloc(req, vllm_blocks([]), 0)
    else:  # vLLM's API server refused it: request_finished is all the connector sees
        finish(half, req, RequestStatus.FINISHED_ABORTED)
    meta = half.build_connector_meta(SchedulerOutput.make_empty())
    released = [] if case == "tp_mismatch" else [PeerSpec("p-req", "127.0.0.1", (7000,), LISTED)]
    assert meta.peer_releases == released and meta.loads == []


# ---------------------------------------------------------------- workers with real engines and sockets
def pd_worker(engine, caches, *, serve: bool, rank: int = 0, tp: int = 1):
    config = worker_config(engine)
    worker = WorkerHalf(config, engine_factory=lambda _: engine, block_size=BLOCK, lookup_address=None,
                        peer_factory=lambda eng: PeerTransfer(config, eng, tp_rank=rank, tp_size=tp, mac=None,
                                                              serve=serve))
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    return worker


@pytest.fixture
def prefill():
    engine = make_engine(extra_config={"pd_host": "127.0.0.1"})
    caches = make_caches(True, seed=11)
    worker = pd_worker(engine, caches, serve=True)
    yield worker
    worker.shutdown()
    engine.close()


@pytest.fixture
def decode():
    engine = make_engine(extra_config={"pd_pull_timeout_secs": 0.5})
    worker = pd_worker(engine, make_caches(False), serve=False)
    yield worker
    worker.shutdown()
    engine.close()


TOKENS = list(range(3000, 3000 + 3 * CHUNK + 4))  # three whole chunks and a partial one
P_BLOCKS = list(range(0, 7))
D_BLOCKS = list(range(20, 27))


def prefill_step(worker, req_id="p1"):
    """The step that completes the prompt on the prefill worker: its save and its hold."""
    tokens = np.asarray(TOKENS, dtype=np.int64)
    worker.begin_step()
    worker.wait_for_save(LMCacheConnectorMetadata(
        saves=[SaveSpec(req_id, tokens, P_BLOCKS, 0, is_last=True, for_peer=True)],
        peer_holds=[PeerHoldSpec(req_id, tokens)]))


def pull_meta(port: int, req_id="p1", skip=0) -> LMCacheConnectorMetadata:
    return LMCacheConnectorMetadata(loads=[LoadSpec(
        "d1", np.asarray(TOKENS, dtype=np.int64), D_BLOCKS, skip, len(TOKENS), is_async=True,
        peer=PeerSpec(req_id, "127.0.0.1", (port,), "loopback"))])


def wait_until(check, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not check():
        time.sleep(0.02)
    return check()


def test_decode_worker_gets_the_prefill_workers_kv_bit_for_bit(prefill, decode):
    prefill_step(prefill)
    assert wait_until(lambda: prefill.pd.holds.checkout("p1", []).state.value == "ready")
    meta = pull_meta(prefill.pd.port)
    decode.begin_step()
    decode.start_load_kv(meta)
    assert finish_async(decode, meta)[0] == {"d1"}
    assert decode.take_load_errors() == set()
    n = len(TOKENS)
    assert torch.equal(kv_of(decode.engine, decode.kv_caches, slots(D_BLOCKS)[:n]),
                       kv_of(prefill.engine, prefill.kv_caches, slots(P_BLOCKS)[:n]))
    assert wait_until(lambda: len(prefill.pd.holds) == 0)  # released by the pull
    assert metrics.value("pd_pulled_chunks", peer="loopback") == 4  # a bounded label, not the peer's host:port


def test_decode_worker_skips_what_vllm_has_and_reports_a_dead_prefill_as_load_errors(prefill, decode):
    prefill_step(prefill)
    port = prefill.pd.port
    prefill.pd.close()  # the prefill instance is gone
    meta = pull_meta(port, skip=CHUNK)
    decode.begin_step()
    decode.start_load_kv(meta)
    assert finish_async(decode, meta)[0] == {"d1"}
    # Tokens [32, 100) were to be loaded: their blocks are reported for recompute (block 20 held 0..15).
    assert decode.take_load_errors() == set(D_BLOCKS[CHUNK // BLOCK:])
    assert metrics.value("pd_pull_failures", reason="unreachable") == 1  # refused at once, no wait for a timeout


def test_releases_and_aborts_drop_holds(prefill, decode):
    prefill_step(prefill, "p1")
    prefill_step(prefill, "p2")
    assert len(prefill.pd.holds) == 2
    decode.begin_step()
    decode.wait_for_save(LMCacheConnectorMetadata(peer_releases=[PeerSpec("p1", "127.0.0.1", (prefill.pd.port,))]))
    prefill.begin_step()
    prefill.wait_for_save(LMCacheConnectorMetadata(peer_unholds=["p2"]))
    assert wait_until(lambda: len(prefill.pd.holds) == 0)
    assert metrics.value("pd_holds_released") == 2


def test_prefill_workers_report_their_cap_once_and_every_hold_that_ended(prefill):
    """What the scheduler half's ledger hears (connector worker metadata): the cap in tokens in the first
    report, then a report only when holds ended."""
    first = prefill.hold_report()
    holds = prefill.pd.holds
    chunk_bytes = holds.max_bytes and kv_bytes_per_chunk(prefill)
    assert first is not None and first.ended == [] and first.cap_tokens == holds.max_bytes * CHUNK // chunk_bytes
    assert prefill.hold_report() is None
    prefill_step(prefill, "p1")
    prefill.begin_step()
    prefill.wait_for_save(LMCacheConnectorMetadata(peer_unholds=["p1"]))
    assert wait_until(lambda: len(holds) == 0)
    assert prefill.hold_report() == HoldReport(["p1"], first.cap_tokens)
    assert prefill.hold_report() is None


def kv_bytes_per_chunk(worker) -> int:
    layout = worker.pd.engine.layout
    return int(torch.zeros(layout.chunk_shape(CHUNK), dtype=layout.geometry.dtype).nbytes)


def test_a_decode_instance_of_another_tp_size_releases_every_prefill_rank(decode):
    """P with TP 2 (two ranks, two transfer servers), D with TP 1 refusing it: D's one rank tells both."""
    ranks = []
    try:
        for rank in range(2):
            engine = make_engine(extra_config={"pd_host": "127.0.0.1"})
            ranks.append((pd_worker(engine, make_caches(True, seed=rank), serve=True, rank=rank, tp=2), engine))
        for worker, _ in ranks:
            prefill_step(worker)
        assert wait_until(lambda: all(w.pd.holds.checkout("p1", []).state.value == "ready" for w, _ in ranks))
        decode.begin_step()
        decode.wait_for_save(LMCacheConnectorMetadata(peer_releases=[
            PeerSpec("p1", "127.0.0.1", tuple(w.pd.port for w, _ in ranks))]))
        assert wait_until(lambda: all(len(w.pd.holds) == 0 for w, _ in ranks))
    finally:
        for worker, engine in ranks:
            worker.shutdown()
            engine.close()
