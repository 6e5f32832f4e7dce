"""The shared decoder (eager, before any compilation) matches transformers' Llama on tiny
random configs: GQA/MHA, tied/untied, rope variants, biases, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from parity import max_error, nxdc_logits, reference_logits
from tiny import tiny_llama_config

from nxdc.archs import get_arch, spec_from_config
from nxdc.model.decoder import ContextEncoding, Decoder, TokenGeneration
from nxdc.model.fused import fuse_state_dict

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
CASES = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "llama3-rope": {"rope_scaling": LLAMA3},
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "bias-odd-heads": {
        "attention_bias": True,
        "mlp_bias": True,
        "hidden_size": 72,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
    },
}
# built by other tests (not parity-checked here): every row a multiple of 256 inputs, for int4-k
BUILD_ONLY = {"wide": {"hidden_size": 256, "intermediate_size": 512}}
# fp32: both sides do the same math in a different order; bf16: rounding of 8-bit mantissas
# through two layers, relative to logits of magnitude ~1.
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2}


def build(case: str, dtype, batch: int, max_seq: int, **modes):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny_llama_config(**{**CASES, **BUILD_ONLY}[case])
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    hf = hf.to(dtype)
    spec = spec_from_config(cfg.to_dict())
    ours = Decoder(spec, batch, max_seq, dtype, **modes).eval()  # modes: kernels, kv_update
    arch = get_arch("llama")
    sd = fuse_state_dict(
        {arch.weight_name(k): v for k, v in hf.state_dict().items() if arch.weight_name(k)}, ours
    )
    result = ours.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith(("_cache",)) for k in result.missing_keys), result.missing_keys
    return hf, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_decoder_matches_transformers(case, dtype):
    hf, ours = build(case, dtype, batch=2, max_seq=32)
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (2, 20))
    lens = [9, 5]
    ref = reference_logits(hf, ids)
    ce, tg = ContextEncoding(ours), TokenGeneration(ours, 32)

    def prefill(prompts):
        t = 16
        x = torch.zeros(2, t, dtype=torch.int64)
        last = torch.tensor([len(p) - 1 for p in prompts])
        for i, p in enumerate(prompts):
            x[i, : len(p)] = torch.tensor(p)
        with torch.no_grad():
            return ce(x, last)

    def decode(toks, pos):
        with torch.no_grad():
            return tg(toks.view(-1, 1), pos)

    err = max_error(ref, nxdc_logits(prefill, decode, ids, lens), lens)
    assert err < TOL[dtype], f"{case} {dtype}: max abs logit error {err}"
