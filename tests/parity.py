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


def tiny_export_check(export, reference_export) -> float:
    """For an export of the tiny GQA model with verify graphs (any tp): the largest logit
    difference from ``reference_export`` over teacher-forced prefill + decode, after checking
    that prompt-lookup speculation (k = 2) reproduces plain greedy token for token."""
    from tiny import tiny_tokenizer

    from nxdc.generation.loop import generate
    from nxdc.generation.speculative import PromptLookup, Speculator
    from nxdc.runtime.runner import Runner
    from nxdc.runtime.workers import open_runner

    torch.manual_seed(5)
    ids, lens = torch.randint(3, 256, (2, 24)), [9, 14]
    ref = Runner.load(reference_export)
    want = nxdc_logits(ref.prefill, ref.decode, ids, lens)
    sess = open_runner(export)
    try:
        got = nxdc_logits(sess.prefill, sess.decode, ids, lens)
        prompts = ["w1 w2 w3 w4 w1 w2 w3", "w5 w6 w5 w6"]
        tok = tiny_tokenizer()
        plain = generate(sess, tok, prompts, max_new_tokens=30, eos_ids=set())
        spec = generate(
            sess, tok, prompts, 30, eos_ids=set(), speculator=Speculator(PromptLookup(3), 2, sess)
        )
        assert [s.token_ids for s in spec.sequences] == [s.token_ids for s in plain.sequences]
        assert spec.speculation["accepted"] > 0
    finally:
        sess.close()
    return max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True))
