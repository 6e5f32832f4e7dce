"""Tiny random-weight Hugging Face checkpoints for tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(253)]

# The shared tiny GQA export: two prefill buckets and two decode buckets, batch 2.
GQA_EXPORT = dict(batch_size=2, sequence_length=64, context_buckets=(16, 32), decode_buckets=(32, 64))
# The same model for `nxdc serve`: 8 rows, single-row prefill chunks of 8 and 32 tokens, decode
# graphs over all 8 rows and over 1 row.
SERVE_EXPORT = dict(
    batch_size=8,
    sequence_length=64,
    context_buckets=(32,),
    decode_buckets=(64,),
    chunk_buckets=(8, 32),
    decode_batch_sizes=(1,),
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


# the shape every tiny test model starts from (architectures and tests override parts of it)
TINY_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_BASE, **overrides})


def make_tiny_llama(path: Path, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Write a random tiny Llama checkpoint (config.json + safetensors + tokenizer)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()
    # a larger init than the default makes logits spread out, so parity checks mean something
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return path


# Tiny configs of every supported architecture: GQA 4/2 heads, head_dim 16, 2 layers. The
# MoE ones have 8 experts (top 2 / top 3) so that an fp32 batch-2 decode step (2*k < 8) and a
# prefill take different expert paths (nxdc.model.moe); qwen3_moe's expert size 80 is padded at
# tp 3 (27 per rank) and bf16-aligned at tp 2.
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 80, "norm_topk_prob": False},
    ),
}


def tiny_config(arch: str, **overrides):
    """A tiny random-init config of ``arch`` (a key of TINY_ARCHS) in transformers' own class;
    MoE experts run transformers' plain per-expert loop (the reference implementation)."""
    import transformers

    config_cls, _, extra = TINY_ARCHS[arch]
    base = {**TINY_BASE, "head_dim": 16, "experts_implementation": "eager", **extra, **overrides}
    return getattr(transformers, config_cls)(**base)


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """transformers' model of ``arch`` with random weights (fp32, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, TINY_ARCHS[arch][1])(tiny_config(arch, **overrides)).eval()
    # a larger init than the default makes logits spread out, so parity checks mean something
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.2)  # not all ones, so a q/k norm that is skipped shows
    return model


def make_tiny(arch: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny checkpoint of ``arch`` (config.json + safetensors + tokenizer)."""
    tiny_hf_model(arch, seed, **overrides).save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return path
