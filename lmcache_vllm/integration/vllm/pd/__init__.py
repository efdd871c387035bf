"""Disaggregated prefill and decode with vLLM's kv_transfer_params (docs/DISAGGREGATED.md): the params
(`params.py`), which prefill instances a decode instance pulls from (`trust.py`), the scheduler side
(`scheduler.py`) and the worker side (`worker.py`)."""
