"""Speculative decoding: greedy output equals plain greedy token for token (prompt lookup and
draft models, several k, batch 2, rejection at every position of the window), and
speculative sampling draws from the target's distribution (chi-square)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import GQA_EXPORT, tiny_tokenizer
from typer.testing import CliRunner

from nxdc.cli.main import app
from nxdc.generation.loop import generate
from nxdc.generation.sampling import Sampler, SamplingParams
from nxdc.generation.speculative import DraftModel, PromptLookup, Speculator, accept
from nxdc.runtime.runner import Runner

K = 4  # the exports' verify graphs score K draft tokens (+1) per call
SMOLLM2 = dict(batch_size=1, sequence_length=128, context_buckets=(64,))  # as conftest's smollm2_export
# random tiny-model text quickly falls into loops, which prompt lookup then drafts from
TINY_PROMPTS = ["w1 w2 w3 w4 w5 w1 w2 w3", "w9 w8 w7 w9 w8"]


def _export(src, out, **opts):
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    run_export(str(src), out, ExportOptions(**opts))
    return out


@pytest.fixture(scope="session")
def tiny_spec_export(tiny_gqa, cache_dir, tmp_path_factory):
    # same buckets as tiny_gqa_export: only the verify graphs are new compiles
    return _export(
        tiny_gqa, tmp_path_factory.mktemp("exports") / "tiny-spec", **GQA_EXPORT, speculation_length=K
    )


@pytest.fixture(scope="session")
def tiny_draft_export(tiny_gqa, cache_dir, tmp_path_factory):
    return _export(tiny_gqa, tmp_path_factory.mktemp("exports") / "tiny-draft", **GQA_EXPORT, num_layers=1)


def _plain(session, prompts, n=40, sampling=None, **kw):
    return generate(
        session, tiny_tokenizer(), prompts, max_new_tokens=n, sampling=sampling, eos_ids=set(), **kw
    )


def _ids(res):
    return [s.token_ids for s in res.sequences]


@pytest.mark.parametrize("k", [1, 2, K])
def test_prompt_lookup_greedy_equals_plain_tiny(tiny_spec_export, k):
    sess = Runner.load(tiny_spec_export)
    plain = _plain(sess, TINY_PROMPTS)
    spec = _plain(sess, TINY_PROMPTS, speculator=Speculator(PromptLookup(3), k, sess))
    assert _ids(spec) == _ids(plain)
    st = spec.speculation
    assert st["proposed"] > 0 and 0 < st["accepted"] <= st["proposed"]
    assert st["target_calls"] < plain.decode_steps  # it did save target calls


@pytest.mark.parametrize("k", [1, 3, K])
def test_draft_model_greedy_equals_plain_tiny(tiny_spec_export, tiny_draft_export, k):
    sess = Runner.load(tiny_spec_export)
    plain = _plain(sess, TINY_PROMPTS)
    drafter = DraftModel(Runner.load(tiny_draft_export), sess)
    spec = _plain(sess, TINY_PROMPTS, speculator=Speculator(drafter, k, sess))
    assert _ids(spec) == _ids(plain)
    assert spec.speculation["proposed"] > 0


class _Oracle:
    """Drafts the known greedy continuation, wrong from window position ``bad`` on (None:
    never wrong): every step is then rejected exactly at ``bad``."""

    mode = "oracle"

    def __init__(self, truth: list[list[int]], prompts: list[list[int]], bad: int | None):
        self.truth, self.prompts, self.bad = truth, prompts, bad
        self.expected_accepts = 0  # what a correct verifier must accept, summed over calls

    def start(self, prompts):
        pass

    def propose(self, contexts, k, sampler):
        out = {}
        for i, ctx in contexts.items():
            done = len(ctx) - len(self.prompts[i])
            d = self.truth[i][done : done + k]
            if self.bad is not None and self.bad < len(d):
                d[self.bad] = (d[self.bad] + 1) % 256
            self.expected_accepts += len(d) if self.bad is None else min(self.bad, len(d))
            out[i] = d
        return out, None


@pytest.mark.parametrize("bad", [*range(K), None])
def test_rejection_at_every_window_position(tiny_spec_export, bad):
    sess = Runner.load(tiny_spec_export)
    tok = tiny_tokenizer()
    plain = _plain(sess, TINY_PROMPTS, n=30)
    prompts = [tok(p)["input_ids"] for p in TINY_PROMPTS]
    oracle = _Oracle(_ids(plain), prompts, bad)
    spec = _plain(sess, TINY_PROMPTS, n=30, speculator=Speculator(oracle, K, sess))
    assert _ids(spec) == _ids(plain)
    st = spec.speculation
    assert st["proposed"] > 0 and st["accepted"] == oracle.expected_accepts
    if bad is None:  # all accepted: K + 1 tokens per call for both sequences until the end
        assert st["tokens_per_call"] > K


def _chi2_pvalue(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma function."""
    t = lambda v: torch.tensor(float(v), dtype=torch.float64)  # noqa: E731
    return float(torch.special.gammaincc(t(df / 2), t(stat / 2)))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs``."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token the target gives probability 0"
    obs, expected = counts[keep].double(), probs[keep].double() * counts.sum()
    return _chi2_pvalue(float(((obs - expected) ** 2 / expected).sum()), int(keep.sum()) - 1)


def _contingency_p(table: torch.Tensor) -> float:
    """Two-sample test: do the columns of ``table`` (outcome counts) share one distribution?"""
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return _chi2_pvalue(stat, (table.shape[0] - 1) * (table.shape[1] - 1))


@pytest.mark.parametrize("draft_kind", ["model", "point-mass"])
def test_speculative_sampling_matches_target_distribution(draft_kind):
    """The first token a verify step emits follows the target's p whatever q proposes."""
    vocab, k, n = 6, 3, 20000
    torch.manual_seed(0)
    logits = torch.randn(k + 1, vocab) * 1.5
    q_logits = torch.randn(k, vocab) * 1.5
    sampler = Sampler(SamplingParams(do_sample=True, temperature=0.9, seed=1))
    p0 = sampler.probs(logits[0])
    counts = torch.zeros(vocab)
    gen = torch.Generator().manual_seed(2)
    for _ in range(n):
        if draft_kind == "model":
            q = [q_logits[j].softmax(-1) for j in range(k)]
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        else:
            q, draft = None, [int(x) for x in torch.randint(0, vocab, (k,), generator=gen)]
        accepted, tok = accept(logits, draft, q, sampler)
        counts[draft[0] if accepted else tok] += 1
    assert _chi_square_p(counts, p0) > 1e-3


def test_speculative_sampling_end_to_end_chi_square(tiny_spec_export, tiny_draft_export):
    """Joint distribution of the 2nd and 3rd tokens (made by verify calls) over many seeds:
    speculative sampling with the draft model vs plain sampling (two-sample chi-square)."""
    sess = Runner.load(tiny_spec_export)
    drafter = DraftModel(Runner.load(tiny_draft_export), sess)
    prompt = ["w1 w2 w3"]
    seen: dict[tuple, list[int]] = {}
    runs = 600
    for which in (0, 1):
        for seed in range(runs):
            sp = SamplingParams(do_sample=True, top_k=3, seed=seed)
            spec = Speculator(drafter, 2, sess) if which else None
            ids = _plain(sess, prompt, n=3, sampling=sp, speculator=spec).sequences[0].token_ids
            seen.setdefault(tuple(ids[1:3]), [0, 0])[which] += 1
    table = torch.tensor([v for v in seen.values() if sum(v) >= 10], dtype=torch.float64)
    assert table.shape[0] >= 3  # the test has several outcomes to compare
    assert _contingency_p(table) > 1e-3


@pytest.mark.slow  # uses the SmolLM2 export as a draft with another tokenizer
def test_cli_speculation_errors_and_stats(
    tiny_gqa_export, tiny_spec_export, tiny_draft_export, smollm2_export
):
    r = CliRunner()
    no_verify = r.invoke(app, ["generate", str(tiny_gqa_export), "-p", "w1 w2", "--prompt-lookup", "2"])
    assert no_verify.exit_code != 0 and "--speculation-length" in no_verify.output
    both = r.invoke(
        app,
        [
            "generate",
            str(tiny_spec_export),
            "-p",
            "w1",
            "--prompt-lookup",
            "2",
            "--draft",
            str(tiny_draft_export),
        ],
    )
    assert both.exit_code != 0 and "pick one" in both.output
    too_long = r.invoke(
        app,
        ["generate", str(tiny_spec_export), "-p", "w1", "--prompt-lookup", "2", "--speculation-length", "9"],
    )
    assert too_long.exit_code != 0 and "1..4" in too_long.output
    other_tok = r.invoke(app, ["generate", str(tiny_spec_export), "-p", "w1", "--draft", str(smollm2_export)])
    assert other_tok.exit_code != 0 and "different tokenizer" in other_tok.output
    ok = r.invoke(
        app,
        [
            "generate",
            str(tiny_spec_export),
            "-p",
            TINY_PROMPTS[0],
            "--draft",
            str(tiny_draft_export),
            "--json",
            "-n",
            "12",
        ],
    )
    assert ok.exit_code == 0, ok.output
    st = json.loads(ok.stdout)["stats"]["speculation"]
    assert st["mode"] == "draft" and st["speculation_length"] == K and st["proposed"] > 0
    assert 0 <= st["acceptance_rate"] <= 1 and st["tokens_per_call"] >= 1


def test_num_layers_export_validation(tiny_gqa, tmp_path):
    r = CliRunner()
    res = r.invoke(
        app, ["export", str(tiny_gqa), "-o", str(tmp_path / "x"), "--num-layers", "2", "--dry-run"]
    )
    assert res.exit_code != 0 and "below the model's 2 layers" in res.output
    res = r.invoke(
        app,
        [
            "export",
            str(tiny_gqa),
            "-o",
            str(tmp_path / "x"),
            "--speculation-length",
            "3",
            "--dry-run",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    buckets = json.loads(res.stdout)["plan"]["buckets"]
    verify = [b["length"] for b in buckets if b["kind"] == "verify"]
    assert verify and verify == [b["length"] for b in buckets if b["kind"] == "decode"]


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, K])
def test_smollm2_prompt_lookup_and_self_draft_greedy_equal_plain(
    smollm2_spec_export, smollm2_draft_export, k
):
    from test_smollm2 import PROMPTS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_spec_export)
    sess = Runner.load(smollm2_spec_export)
    prompts = [
        *PROMPTS[:2],
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    ]
    for p in prompts:
        plain = generate(sess, tok, [p], max_new_tokens=32, chat=True, eos_ids=set())
        for drafter in (PromptLookup(3), DraftModel(Runner.load(smollm2_draft_export), sess)):
            spec = generate(
                sess,
                tok,
                [p],
                max_new_tokens=32,
                chat=True,
                eos_ids=set(),
                speculator=Speculator(drafter, k, sess),
            )
            assert _ids(spec) == _ids(plain), (p, drafter.mode)


@pytest.fixture(scope="session")
def smollm2_spec_export(cache_dir, tmp_path_factory):
    # the smollm2_export fixture's prompt graph (cached) plus decode and verify graphs on int8
    # activations (--decode-matmul int8): a verify row must equal a decode row there too
    return _export(
        "smollm2-135m",
        tmp_path_factory.mktemp("exports") / "smollm2-spec",
        **SMOLLM2,
        speculation_length=K,
        decode_matmul="int8",
    )


@pytest.fixture(scope="session")
def smollm2_draft_export(cache_dir, tmp_path_factory):
    return _export(
        "smollm2-135m", tmp_path_factory.mktemp("exports") / "smollm2-draft", **SMOLLM2, num_layers=4
    )
