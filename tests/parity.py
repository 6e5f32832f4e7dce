"""Helpers that compare nxdc logits with transformers' on the same tokens."""

from __future__ import annotations

import torch


def reference_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits [B, T, V] from transformers, in fp32."""
    with torch.no_grad():
        return hf_model(ids).logits.float()


def nxdc_logits(prefill, decode, ids: torch.Tensor, prompt_lens: list[int]) -> list[torch.Tensor]:
    """Teacher-forced nxdc logits: prefill each row's first ``prompt_lens[i]`` tokens, then
    decode the rest one position at a time. Returns, per row, logits [T - len + 1, V] for
    positions len-1 .. T-1."""
    b, t = ids.shape
    rows = [[] for _ in range(b)]
    first = prefill([ids[i, : prompt_lens[i]].tolist() for i in range(b)])
    for i in range(b):
        rows[i].append(first[i].float())
    pos = torch.tensor(prompt_lens, dtype=torch.int64)
    while int(pos.min()) < t:
        active = pos < t
        toks = torch.stack([ids[i, min(int(pos[i]), t - 1)] for i in range(b)])
        out = decode(toks, torch.minimum(pos, torch.tensor(t - 1)))
        for i in range(b):
            if active[i]:
                rows[i].append(out[i].float())
        pos = pos + 1
    return [torch.stack(r) for r in rows]


def max_error(ref: torch.Tensor, ours: list[torch.Tensor], prompt_lens: list[int]) -> float:
    worst = 0.0
    for i, rows in enumerate(ours):
        want = ref[i, prompt_lens[i] - 1 :]
        assert rows.shape == want.shape, (rows.shape, want.shape)
        worst = max(worst, (rows - want).abs().max().item())
    return worst


def hf_greedy(hf_model, ids: torch.Tensor, new_tokens: int, pad_token_id: int) -> list[int]:
    """transformers greedy continuation (EOS ignored). The attention mask is explicit: with
    SmolLM2's chat template the pad id (<|im_end|>) occurs in prompts and would be masked."""
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )
    return out[0, ids.shape[1] :].tolist()
