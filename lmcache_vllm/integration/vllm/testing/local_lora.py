"""Tiny LoRA adapters (PEFT format) for the local test model, built on local disk without any hub.

A PEFT adapter is `adapter_config.json` plus `adapter_model.safetensors` holding `lora_A` ([r, in]) and
`lora_B` ([out, r]) per target module. `build_lora(model_dir, out, seed)` writes one for the attention
projections of a model built by `local_model.build_model`; different seeds give different adapters
(and so different KV for the same tokens). `lora_B` is not zero (PEFT initialises it to zero, which
would make the adapter a no-op and hide a key that ignores it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_lora(model_dir: str | os.PathLike, out: str | os.PathLike, seed: int, rank: int = 8,
               scale: float = 0.5) -> Path:
    """Writes a rank-`rank` adapter for the Llama in `model_dir` into `out` (created) and returns it."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv_out = config["num_key_value_heads"] * head_dim
    outs = {"q_proj": hidden, "k_proj": kv_out, "v_proj": kv_out, "o_proj": hidden}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=gen) * scale).to(torch.bfloat16)
            lora_b = torch.randn(outs[module], rank, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False}, indent=1))
    return target
