"""Tiny random-weight Hugging Face checkpoints for tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(253)]

# The shared tiny GQA export: two prefill buckets and two decode buckets, batch 2.
GQA_EXPORT = dict(batch_size=2, sequence_length=64, context_buckets=(16, 32), decode_buckets=(32, 64))


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    base = dict(
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
    base.update(overrides)
    return LlamaConfig(**base)


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
