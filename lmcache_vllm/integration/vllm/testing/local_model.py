"""A small Llama model and byte-level BPE tokenizer built on local disk, without any model hub.

Tests, examples and benchmarks need a model vLLM can load; none can be downloaded here. `build_model`
writes a randomly initialised (fixed seed) Llama in bf16 plus a tokenizer trained on the Python
standard library's source files, into a directory keyed by the recipe, and reuses it on later calls.
The `-swa` recipes alternate full-attention and sliding-window layers (`layer_types` and `sliding_window`
in the config, which vLLM's Llama reads per layer): a hybrid model whose KV cache vLLM splits into a
full-attention and a sliding-window group. `tiny-mamba` is a Granite-4-style hybrid
(`GraniteMoeHybridForCausalLM`, dense): Mamba2 layers beside attention layers, a state group and an
attention group.

    python -m lmcache_vllm.integration.vllm.testing.local_model --out DIR [--size tiny|medium|tiny-swa|...]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

RECIPE_VERSION = 1
_DONE_MARKER = "lmcache_vllm_recipe.json"


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """Everything that decides the bytes of the built model (its hash names the cache directory)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 4096
    max_position_embeddings: int = 8192
    # 0.02 (transformers' default) makes greedy output of random weights repeat itself, which would
    # hide wrong KV in tests; 0.1 gives varied tokens.
    initializer_range: float = 0.1
    seed: int = 0
    tokenizer_files: int = 200  # stdlib .py files the tokenizer trains on
    sliding_window: int = 0  # > 0: odd layers attend to this many tokens (layer_types alternate)
    kind: str = "llama"  # "llama" | "granite-hybrid" (odd layers attention, even layers Mamba2)

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        for name, default in (("sliding_window", 0), ("kind", "llama")):
            if fields[name] == default:
                del fields[name]  # the digests (and cache directories) of earlier recipes stay as they were
        blob = json.dumps({"v": RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def layer_types(self) -> list[str] | None:
        if not self.sliding_window:
            return None
        return ["sliding_attention" if i % 2 else "full_attention" for i in range(self.num_layers)]


RECIPES = {
    "tiny": ModelRecipe("tiny", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                        num_kv_heads=2),
    "medium": ModelRecipe("medium", hidden_size=1024, intermediate_size=2816, num_layers=8,
                          num_heads=16, num_kv_heads=4),
    "tiny-swa": ModelRecipe("tiny-swa", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                            num_kv_heads=2, sliding_window=512),
    "medium-swa": ModelRecipe("medium-swa", hidden_size=1024, intermediate_size=2816, num_layers=8,
                              num_heads=16, num_kv_heads=4, sliding_window=1024),
    "tiny-mamba": ModelRecipe("tiny-mamba", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                              num_kv_heads=2, kind="granite-hybrid"),
}


def default_cache_dir() -> Path:
    base = os.environ.get("LMCACHE_VLLM_MODEL_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmcache-vllm" / "models"


def _training_files(limit: int) -> list[str]:
    """Sorted stdlib .py files: the same corpus (and so the same tokenizer) on every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:limit]


def _build_tokenizer(recipe: ModelRecipe, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<unk>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(_training_files(recipe.tokenizer_files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(str(out))


def _build_granite_hybrid(recipe: ModelRecipe, out: Path) -> None:
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        layer_types=["attention" if i % 2 else "mamba" for i in range(recipe.num_layers)],
        num_local_experts=0, shared_intermediate_size=recipe.intermediate_size, position_embedding_type="rope",
        mamba_n_heads=8, mamba_d_head=2 * recipe.hidden_size // 8, mamba_n_groups=1, mamba_d_state=64,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, time_step_limit=(0.0, 1e30),
        max_position_embeddings=recipe.max_position_embeddings, initializer_range=recipe.initializer_range,
        bos_token_id=0, eos_token_id=1, pad_token_id=3, tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(recipe.seed)
    GraniteMoeHybridForCausalLM(cfg).to(torch.bfloat16).save_pretrained(  # type: ignore[arg-type]  # as above
        str(out))


def _build_weights(recipe: ModelRecipe, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if recipe.kind == "granite-hybrid":
        _build_granite_hybrid(recipe, out)
        return

    cfg = LlamaConfig(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        initializer_range=recipe.initializer_range, bos_token_id=0, eos_token_id=1,
        pad_token_id=3, tie_word_embeddings=False, torch_dtype="bfloat16")  # type: ignore[call-arg]  # a **kwargs key the stubs of this transformers omit
    if recipe.sliding_window:  # read by vLLM's Llama per layer; the weights do not depend on them
        cfg.layer_types = recipe.layer_types()
        cfg.sliding_window = recipe.sliding_window
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types to() wrongly
    model.save_pretrained(str(out))


def build_model(size: str = "tiny", out: str | os.PathLike | None = None) -> Path:
    """Returns a directory holding the model of recipe `size`, building it there first if needed.

    `out` is used as given; without it the model lives in `default_cache_dir()/<size>-<recipe hash>`.
    Building goes to a temporary sibling directory that is renamed at the end, so an interrupted build
    never leaves a half-written model that a later call would take as done.
    """
    if size not in RECIPES:
        raise ValueError(f"unknown model size {size!r}; known: {sorted(RECIPES)}")
    recipe = RECIPES[size]
    target = Path(out) if out is not None else default_cache_dir() / f"{size}-{recipe.digest()}"
    marker = target / _DONE_MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()).get("digest") == recipe.digest():
                return target
        except (OSError, ValueError):
            pass
        raise FileExistsError(f"{target} holds a different model build; remove it or pick another dir")
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not a model built by this recipe")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build_tokenizer(recipe, staging)
        _build_weights(recipe, staging)
        (staging / _DONE_MARKER).write_text(
            json.dumps({"digest": recipe.digest(), **dataclasses.asdict(recipe)}, indent=1))
        if target.exists():
            target.rmdir()
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first: theirs is as good as ours.
            if not (target / _DONE_MARKER).exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory to write (default: the shared cache)")
    parser.add_argument("--size", default="tiny", choices=sorted(RECIPES))
    args = parser.parse_args(argv)
    print(build_model(args.size, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
