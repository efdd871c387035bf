"""`LMCacheConnector` beside other connectors (integration/vllm/composition.py, docs/COMPOSING.md), against vLLM's own
`KVConnectorFactory` and `MultiConnector`: the name registered on import (idempotent), every class method
MultiConnector calls on a child working by name (its API server's stats rebuild in a fresh process), the
MultiConnector found from inside a child with its policy warned about once, `extra_config.pd` auto/on/off, our
prefill params under our own key beside a connector that may answer params too (and read back by a decode
instance), a request's `max_load_tokens`, and `reset_cache` never answering vLLM False."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from test_integration_pd import TOY_PROXY_PREFILL, finish, pd_request  # noqa: E402
from test_integration_scheduler import PrefixStore, make_request, vllm_blocks  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.integration.vllm import LMCacheConnector  # noqa: E402
from lmcache_vllm.integration.vllm.composition import Composition, register_connector  # noqa: E402
from lmcache_vllm.integration.vllm.pd.params import PARAMS_KEY, parse_remote_prefill  # noqa: E402
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler  # noqa: E402
from lmcache_vllm.integration.vllm.pd.trust import PeerTrust  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402

CHUNK, BLOCK = 256, 128
OURS = {"kv_connector": "LMCacheConnector", "kv_connector_module_path": "lmcache_vllm.integration.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"chunk_size": CHUNK, "max_local_cpu_size": 0.02,
                                                             "lookup_timeout_ms": 200}}
EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# vLLM's NIXL connector's kv_transfer_params of a finished prefill (the keys MultiConnector would compare ours with)
NIXL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
               "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600,
               "tp_size": 1}


def multi(*children: dict, **top) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": list(children)}, **top)


# ---------------------------------------------------------------- the factory, by name
def test_registered_on_import_idempotently_and_every_class_method_works_by_name():
    assert register_connector() is False  # the import above registered it; again: no error
    assert register_connector() is False
    assert KVConnectorFactory.get_connector_class_by_name("LMCacheConnector") is LMCacheConnector
    layerwise = dict(OURS, kv_connector_extra_config={"use_layerwise": True})
    assert MultiConnector.requires_piecewise_for_cudagraph({"connectors": [EXAMPLE, layerwise]}) is True
    assert MultiConnector.requires_piecewise_for_cudagraph({"connectors": [OURS, EXAMPLE]}) is False
    assert MultiConnector.all_children_support_hma(multi(OURS, OURS)) is True
    assert MultiConnector.all_children_support_hma(multi(OURS, EXAMPLE)) is False  # ExampleConnector is not HMA
    assert MultiConnector.get_required_kvcache_layout(VllmConfig(kv_transfer_config=multi(OURS, EXAMPLE))) is None
    child = KVTransferConfig(**OURS)
    assert LMCacheConnector.supports_sleep_mode(child) is False  # what vLLM 0.33's MultiConnector asks
    stats = MultiConnector.build_kv_connector_stats({"LMCacheConnector": {"counters": {"hit_tokens": {"": 7}}}})
    assert stats.reduce()["LMCacheConnector"]["hit_tokens"] == 7


API_SERVER = """
import sys
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
config = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
    "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
                   {"kv_connector": "LMCacheConnector", "kv_connector_module_path": "lmcache_vllm.integration.vllm",
                    "kv_role": "kv_both"}]})
prom = KVConnectorProm(VllmConfig(kv_transfer_config=config), ["model_name", "engine"], {0: ["m", "0"]})
logging_ = KVConnectorLogging(config)
step = {"LMCacheConnector": {"counters": {"hit_tokens": {"local_cpu": 512}}}}  # MultiKVConnectorStats.to_dict()
logging_.observe(step)
prom.observe(step, 0)
lines = []
logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
print("hit_tokens" in lines[0] and "512" in lines[0])
"""


def test_multiconnector_rebuilds_our_stats_by_name_in_a_fresh_api_server_process():
    """vLLM's API server builds the metrics of a MultiConnector (which imports us by module path) and then turns
    every step's stats dict back into our stats class by name: before the registration this raised
    `Connector 'LMCacheConnector' is not registered` for every request."""
    out = subprocess.run([sys.executable, "-c", API_SERVER], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


# ---------------------------------------------------------------- the rules
def test_pd_mode_and_params_form_follow_the_other_children():
    alone = Composition()
    assert alone.pd_enabled("auto") and not alone.namespaced_params and alone.load_policy_warning() is None
    beside_nixl = Composition.of_children([NIXL, OURS], 1, "fail")
    assert beside_nixl.siblings == ("NixlConnector",) and beside_nixl.pd_siblings == ("NixlConnector",)
    assert not beside_nixl.pd_enabled("auto") and beside_nixl.pd_enabled("on") and not beside_nixl.pd_enabled("off")
    assert beside_nixl.namespaced_params  # forced on beside NIXL: no shared key
    assert "NixlConnector beside it does the handoff" in beside_nixl.describe_pd("auto")
    beside_example = Composition.of_children([OURS, EXAMPLE], 0, "recompute")
    assert beside_example.pd_enabled("auto") and not beside_example.namespaced_params
    assert beside_example.load_policy_warning() is None
    for other in ("MooncakeConnector", "P2pNcclConnector", "NixlPullConnector", "MoRIIOConnector"):
        assert not Composition.of_children([OURS, {"kv_connector": other}], 0, None).pd_enabled("auto")
    unknown = Composition.of_children([OURS, {"kv_connector": "OffloadingConnector"}], 0, None)
    assert unknown.pd_enabled("auto") and unknown.namespaced_params  # it might answer params: ours apart
    warning = beside_nixl.load_policy_warning()
    assert warning is not None and '"kv_load_failure_policy": "recompute"' in warning and "copy" in warning


def test_namespaced_prefill_params_share_no_key_and_a_decode_instance_pulls_with_them():
    store = PrefixStore(0)
    config = LMCacheConfig(chunk_size=CHUNK)

    def half(namespaced: bool) -> SchedulerHalf:
        pd = PDScheduler(engine_id="E", host="127.0.0.1", chunk_size=CHUNK, tp_size=1, ask_ports=lambda: [9000],
                         can_load=True, can_save=True, namespaced_params=namespaced,
                         trust=PeerTrust(["127.0.0.1:9000"]), hold_for_any_client=True)
        return SchedulerHalf(config, block_size=BLOCK, lookup_client=store, can_load=True, can_save=True, pd=pd)

    prefill = half(namespaced=True)
    req = pd_request("a", 700, TOY_PROXY_PREFILL)
    prefill.get_num_new_matched_tokens(req, 0)
    prefill.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    from test_integration_scheduler import new_step

    assert prefill.build_connector_meta(new_step(req, list(range(6)), computed=0, scheduled=700)).peer_holds
    _, params = finish(prefill, req)
    assert set(params) == {PARAMS_KEY} and not set(params) & set(NIXL_PARAMS)  # MultiConnector: no clash
    remote = parse_remote_prefill(params)
    assert (remote.req_id, remote.host, remote.ports, remote.num_tokens) == ("a", "127.0.0.1", (9000,), 700)
    decode = half(namespaced=False)  # the decode side reads either form
    pull = pd_request("d", 700, params)
    assert decode.get_num_new_matched_tokens(pull, 0) == (700, True)
    # NIXL's params beside ours (a proxy passing on the merged dict): ours are still found
    merged = pd_request("e", 700, {**NIXL_PARAMS, **params})
    assert parse_remote_prefill(merged.kv_transfer_params).req_id == "a"


# ---------------------------------------------------------------- a real MultiConnector building us
def build(role: KVConnectorRole, transfer: KVTransferConfig):
    from test_integration_connector import SPECS, allocate, vllm_setup

    vllm_config = vllm_setup("LBHNC")
    vllm_config.kv_transfer_config = transfer
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True  # what vLLM does beside a non-HMA child
    kv_cache_config, _ = allocate(vllm_config, SPECS["flash"](), "LBHNC")
    return MultiConnector(vllm_config, role, kv_cache_config)


def policy_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "kv_load_failure_policy is 'fail'" in r.getMessage()]


@pytest.mark.parametrize("pd_mode,pd_on", [("auto", True), ("off", False)])
def test_a_child_of_a_multiconnector_sees_its_siblings_and_its_policy(pd_mode, pd_on, caplog, tmp_path):
    ours = dict(OURS, kv_connector_extra_config=dict(OURS["kv_connector_extra_config"],
                                                     extra_config={"pd": pd_mode}))
    example = dict(EXAMPLE, kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    with caplog.at_level(logging.INFO):
        connector = build(KVConnectorRole.SCHEDULER, multi(example, ours))  # vLLM's default policy: fail
    try:
        (child,) = [c for c in connector.sub_connectors if isinstance(c, LMCacheConnector)]
        pd = child._scheduler.pd
        assert (pd is not None) == pd_on
        assert pd is None or pd.namespaced_params is False  # ExampleConnector never answers params
        assert len(policy_warnings(caplog)) == 1  # once, from the scheduler's instance
        assert any(f"disaggregated prefill {'on' if pd_on else 'off'}" in r.getMessage() for r in caplog.records)
    finally:
        connector.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        fine = build(KVConnectorRole.SCHEDULER, multi(ours, example, kv_load_failure_policy="recompute"))
    fine.shutdown()
    assert policy_warnings(caplog) == []


def test_a_standalone_connector_is_not_a_child(caplog):
    from test_integration_connector import SPECS, allocate, vllm_setup

    vllm_config = vllm_setup("LBHNC")
    kv_cache_config, _ = allocate(vllm_config, SPECS["flash"](), "LBHNC")
    with caplog.at_level(logging.INFO):
        connector = LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert connector._scheduler.pd is not None and connector._scheduler.pd.namespaced_params is False
        assert policy_warnings(caplog) == []
        assert vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"  # standalone: ours counts
    finally:
        connector.shutdown()


# ---------------------------------------------------------------- a request's max_load_tokens
def limited(req_id: str, n: int, limit) -> object:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": {"max_load_tokens": limit}}
    return Request(req_id, list(range(100, 100 + n)), SamplingParams(max_tokens=4, extra_args=extra), None)


def test_max_load_tokens_caps_one_request_in_whole_chunks(caplog):
    store = PrefixStore(768)
    half = SchedulerHalf(LMCacheConfig(chunk_size=CHUNK), block_size=BLOCK, lookup_client=store, can_load=True,
                         can_save=True)
    assert half.get_num_new_matched_tokens(limited("zero", 1000, 0), 0) == (0, False)
    assert store.calls == 0  # 0: not even looked up
    assert half.get_num_new_matched_tokens(make_request("plain", 1000), 0) == (768, False)  # that request only
    assert half.get_num_new_matched_tokens(limited("cap", 1000, 300), 0) == (256, False)  # whole chunks
    assert half.get_num_new_matched_tokens(limited("cap2", 1000, 256), 128) == (128, False)  # beyond vLLM's hit
    assert half.get_num_new_matched_tokens(limited("big", 1000, 10_000), 0) == (768, False)
    assert metrics.value("load_limited_requests") == 4
    with caplog.at_level(logging.WARNING):
        for i, bad in enumerate(("256", -1, True, 1.5, [1], {"a": 1})):
            assert half.get_num_new_matched_tokens(limited(f"bad{i}", 1000, bad), 0) == (768, False)
    assert metrics.value("refused_request_params", param="max_load_tokens") == 6
    assert any("max_load_tokens='256' is not a non-negative integer" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- reset_cache
def test_reset_cache_never_answers_false(monkeypatch):
    from test_integration_connector import SPECS, allocate, vllm_setup

    vllm_config = vllm_setup("LBHNC", {"lookup_timeout_ms": 200})
    kv_cache_config, _ = allocate(vllm_config, SPECS["flash"](), "LBHNC")
    connector = LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert connector.reset_cache() is None  # no worker answers (none runs): not False, vLLM's pause goes on
        client = connector._scheduler.lookup_client
        monkeypatch.setattr(client, "command", lambda command: [1, 0])  # one rank failed to reset
        assert connector.reset_cache() is None
        monkeypatch.setattr(client, "command", lambda command: (_ for _ in ()).throw(OSError("socket gone")))
        assert connector.reset_cache() is None
        assert metrics.value("failed_resets") == 3
        monkeypatch.setattr(client, "command", lambda command: [1, 1])
        assert connector.reset_cache() is True
    finally:
        connector.shutdown()
