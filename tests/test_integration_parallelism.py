"""Parallel layouts: PP / DCP / PCP > 1 refused at start-up with the reason, lookup addresses per (pp, tp)
rank, and the connector refusing before it builds anything."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import ParallelConfig  # noqa: E402

from lmcache_vllm.integration.vllm.parallelism import (  # noqa: E402
    ParallelLayout,
    TPFailureAgreement,
    UnsupportedParallelism,
    check_supported,
)


class _Config:
    """Only what check_supported reads: vLLM's real ParallelConfig."""

    def __init__(self, **parallel):
        self.parallel_config = ParallelConfig(**parallel)


def test_tensor_parallelism_is_supported():
    layout = check_supported(_Config(tensor_parallel_size=2))
    assert (layout.tp_size, layout.pp_size) == (2, 1)


def test_pp_dcp_pcp_are_refused_with_every_reason_at_once():
    with pytest.raises(UnsupportedParallelism) as info:
        check_supported(_Config(pipeline_parallel_size=2, tensor_parallel_size=2,
                                decode_context_parallel_size=2))
    message = str(info.value)
    assert "pipeline_parallel_size=2" in message and "decode_context_parallel_size=2" in message
    assert "CPU backend cannot run PP" in message
    with pytest.raises(UnsupportedParallelism, match="prefill_context_parallel_size=2"):
        check_supported(_Config(prefill_context_parallel_size=2))


def test_every_pipeline_and_tensor_rank_has_its_own_lookup_socket():
    layout = ParallelLayout(tp_size=2, pp_size=2, tp_rank=1, pp_rank=1)
    addresses = layout.lookup_addresses("engine-x")
    assert len(set(addresses)) == 4 and layout.lookup_address("engine-x") in addresses
    assert ParallelLayout(tp_size=2).lookup_addresses("engine-x") == addresses[:2]


def test_agreement_without_tensor_parallelism_is_the_identity():
    assert TPFailureAgreement(1)([True, False]) == [True, False]
    assert TPFailureAgreement(2)([]) == []
