"""``--backend xla``: each bucket lowered to StableHLO through torch-xla and run on its CPU
client. These run where torch-xla is installed: ``make test-xla`` (.venv-xla, torch 2.9.0 +
torch-xla 2.9.0); ``make test`` skips them. Logits match transformers within the fp32 / bf16
tolerances the inductor exports meet, greedy tokens are identical, a second export is all cache
hits, and serving's graphs (row prefill, row decode) give the same tokens as generate."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch-xla is not installed here: `make test-xla` runs these")

from parity import hf_greedy, max_error, nxdc_logits, reference_logits  # noqa: E402
from test_smollm2 import PROMPTS  # noqa: E402
from tiny import GQA_EXPORT, make_tiny_llama  # noqa: E402

from nxdc.generation.loop import encode_prompts, generate  # noqa: E402
from nxdc.pipeline import run_export  # noqa: E402
from nxdc.plan import ExportOptions  # noqa: E402
from nxdc.runtime.runner import Runner  # noqa: E402


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def xla_gqa_export(tiny_gqa, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("xla") / "tiny-gqa"
    res = run_export(str(tiny_gqa), out, ExportOptions(**GQA_EXPORT, backend="xla"))
    assert res.plan.kv_update == "functional"  # the xla backend's default
    return out


def test_tiny_gqa_logits_match_transformers(tiny_gqa, xla_gqa_export):
    run = Runner.load(xla_gqa_export)
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (2, 40))
    lens = [30, 7]  # prefill in bucket 32; decode crosses from the 32-slot to the 64-slot graph
    err = max_error(
        reference_logits(hf_model(tiny_gqa), ids), nxdc_logits(run.prefill, run.decode, ids, lens), lens
    )
    assert err < 2e-5, err


def test_tiny_greedy_matches_transformers(tiny_gqa, xla_gqa_export):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(xla_gqa_export)
    prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8"]
    res = generate(Runner.load(xla_gqa_export), tok, prompts, max_new_tokens=20, eos_ids=set())
    model = hf_model(tiny_gqa)
    for prompt, seq in zip(prompts, res.sequences, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert seq.token_ids == hf_greedy(model, ids, 20, pad_token_id=0)


def test_bucket_files_and_warm_export(tiny_gqa, xla_gqa_export, tmp_path):
    m = json.loads((xla_gqa_export / "nxdc.json").read_text())
    for name, art in m["artifacts"].items():
        assert {"forward.bytecode", "forward.meta"} <= set(art["files"])  # several files per bucket
        assert all(f["path"].startswith(f"artifacts/{name}/") for f in art["files"].values())
    res = run_export(str(tiny_gqa), tmp_path / "again", ExportOptions(**GQA_EXPORT, backend="xla"))
    assert all(b.hit for b in res.buckets), [(b.name, b.reason) for b in res.buckets]


def test_tiny_mha_bf16_tied_logits(tmp_path):
    src = make_tiny_llama(tmp_path / "mha", seed=2, num_key_value_heads=4, tie_word_embeddings=True)
    out = tmp_path / "mha-bf16"
    run_export(
        str(src),
        out,
        ExportOptions(batch_size=1, sequence_length=32, context_buckets=(32,), dtype="bf16", backend="xla"),
    )
    run = Runner.load(out)
    torch.manual_seed(4)
    ids = torch.randint(3, 256, (1, 30))
    ref = reference_logits(hf_model(src, torch.bfloat16), ids)
    err = max_error(ref, nxdc_logits(run.prefill, run.decode, ids, [11]), [11])
    assert err < 6e-2, err


@pytest.fixture(scope="module")
def xla_smollm2_export(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("xla") / "smollm2"
    run_export(
        "smollm2-135m",
        out,
        ExportOptions(batch_size=1, sequence_length=128, context_buckets=(64,), backend="xla"),
    )
    return out


def test_smollm2_logits_match_transformers(xla_smollm2_export, smollm2_reference):
    model, tok = smollm2_reference
    run = Runner.load(xla_smollm2_export)
    ids = torch.tensor([encode_prompts(tok, [PROMPTS[0]], chat=True)[0] + [504, 3458, 282, 4649, 314]])
    n = ids.shape[1] - 5
    err = max_error(reference_logits(model, ids), nxdc_logits(run.prefill, run.decode, ids, [n]), [n])
    assert err < 2e-3, err  # the inductor export's tolerance (tests/test_smollm2.py)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_smollm2_greedy_32_tokens_match_transformers(xla_smollm2_export, smollm2_reference, prompt):
    model, tok = smollm2_reference
    res = generate(
        Runner.load(xla_smollm2_export), tok, [prompt], max_new_tokens=32, chat=True, eos_ids=set()
    )
    ids = torch.tensor([encode_prompts(tok, [prompt], chat=True)[0]])
    assert res.sequences[0].token_ids == hf_greedy(model, ids, 32, pad_token_id=2)
