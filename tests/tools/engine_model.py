"""Makes the models the real vLLM engines serve in kvgate's tests, and a LoRA adapter.

No weights can be downloaded here and none are needed: a tiny Qwen3 (2 layers, hidden 128,
4 heads, 2 KV heads, head_dim 32: the CPU attention backend takes head sizes 32, 64, 80, ...)
with random weights drawn from a fixed seed, saved with the real Qwen3 tokenizer kvgate
already uses. Its output is noise; its tokenizer, chat template, prefix cache, scheduler, KV
events and metrics are vLLM's. The adapter is a peft LoRA (rank 8 on q/k/v/o_proj) with random
A and B, also from a fixed seed. A second model, a tiny Llama of the same shape saved with
the real Llama 3 tokenizer, serves beside it where a test needs two models tokenized apart.

    python engine_model.py --tokenizer-dir .kvgate/tokenizers/qwen3 \
        --llama-tokenizer-dir .kvgate/tokenizers/llama3 --out DIR

writes DIR/model (config.json, model.safetensors, the tokenizer files), DIR/adapter
(adapter_config.json, adapter_model.safetensors) and DIR/llama (as DIR/model). Run it with
the engine's venv (torch, transformers, safetensors).
"""

import argparse
import json
import shutil
from pathlib import Path

SEED = 20261127
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


# The shape both tiny models share.
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def save_tiny(config, seed: int, tokenizer_dir: Path, out: Path) -> None:
    """Random weights from `seed` for `config`, saved with the tokenizer's files."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def make_model(tokenizer_dir: Path, out: Path) -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=151936, bos_token_id=151643, eos_token_id=151645, **SHAPE)
    save_tiny(config, SEED, tokenizer_dir, out)


def make_llama(tokenizer_dir: Path, out: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128256, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128009, **SHAPE)
    save_tiny(config, SEED + 2, tokenizer_dir, out)


def make_adapter(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(SEED + 1)
    hidden, heads, kv_heads, head_dim = (SHAPE[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    # (in, out) of each projection the adapter changes.
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    tensors = {}
    for layer in range(SHAPE["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, fan_in, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, LORA_RANK, generator=generator) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": LORA_TARGETS,
        "bias": "none",
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--llama-tokenizer-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    parts = (
        ("model", lambda d: make_model(args.tokenizer_dir, d)),
        ("adapter", make_adapter),
        ("llama", lambda d: make_llama(args.llama_tokenizer_dir, d)),
    )
    for part, make in parts:
        target = args.out / part
        partial = args.out / f".{part}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        make(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    print(f"models and adapter in {args.out}")


if __name__ == "__main__":
    main()
