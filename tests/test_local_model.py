"""The hub-free local test model: deterministic builds, cached by recipe, refuses foreign directories."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from lmcache_vllm.integration.vllm.testing.local_model import RECIPES, build_model


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_recipes_have_distinct_stable_digests():
    """Stable: another process, under another hash seed, computes the same digests (built models are cached
    by them; the digest compared with itself in one process could not fail)."""
    assert RECIPES["tiny"].digest() != RECIPES["medium"].digest()
    code = ("from lmcache_vllm.integration.vllm.testing.local_model import RECIPES; "
            "print(' '.join(RECIPES[n].digest() for n in sorted(RECIPES)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.split() == [RECIPES[n].digest() for n in sorted(RECIPES)]
    medium = RECIPES["medium"]
    assert medium.hidden_size // medium.num_heads == 64  # a head size vLLM's CPU backend supports


def test_build_is_deterministic_and_reused(tmp_path):
    a = build_model("tiny", tmp_path / "a")
    b = build_model("tiny", tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json"):
        assert _digest(a / name) == _digest(b / name)
    config = json.loads((a / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["vocab_size"]) == (4, 2, 4096)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_model("tiny", a) == a  # already built: returned as is
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging dirs left


def test_tokenizer_round_trips_text(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_model("tiny", tmp_path / "m")))
    text = "def main(argv):\n    return 0  # done"
    ids = tok(text)["input_ids"]
    assert all(0 <= i < 4096 for i in ids)
    assert tok.decode(ids) == text


def test_refuses_unknown_size_and_foreign_directories(tmp_path):
    with pytest.raises(ValueError):
        build_model("huge", tmp_path / "x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_model("tiny", foreign)


def test_hybrid_recipes_leave_the_digests_of_the_others_alone(tmp_path):
    # Built models are cached by digest: adding the hybrid recipes' fields must not rebuild existing ones.
    assert RECIPES["tiny"].digest() == "0bd14f90c396" and RECIPES["medium"].digest() == "2c3fec6244a6"
    swa = RECIPES["tiny-swa"]
    assert swa.digest() != RECIPES["tiny"].digest() and swa.sliding_window == 512
    config = json.loads((build_model("tiny-swa", tmp_path / "swa") / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention"] * 2
    assert config["sliding_window"] == 512
