"""The inductor backend on a CUDA device (``--device cuda``): compiled logits match transformers
on the same GPU, reduced-precision weights stay in their budget, speculation reproduces greedy.
They need a GPU: where there is none (CI) they are skipped; `make test-cuda` runs them where
there is one. docs/weights.md ("On CUDA") says what has been run where, and with what result."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from parity import max_error, nxdc_logits, reference_logits
from test_export_tiny import hf_model
from test_weights import TINY_TOL as TOL  # against fp32 weights

from nxdc.pipeline import run_export
from nxdc.plan import ExportOptions
from nxdc.runtime.runner import Runner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-cuda)"),
]

# one prefill bucket, one decode bucket: compiles stay few
SMALL = dict(batch_size=2, sequence_length=32, context_buckets=(16,), decode_buckets=(32,), device="cuda")


def _export(job: tuple[str, str, dict]) -> str:
    src, out, extra = job
    run_export(src, Path(out), ExportOptions(**SMALL, **extra))
    return out


@pytest.fixture(scope="module")
def cuda_exports(tiny_gqa, cache_dir, tmp_path_factory):
    """fp32 (with verify graphs for speculation), bf16, and fp32 with each stored weight format,
    compiled in parallel processes (much of a CUDA compile is single-threaded Python and Triton
    work; a GPU machine has the cores)."""
    root = tmp_path_factory.mktemp("cuda-exports")
    variants = {
        "fp32": dict(speculation_length=2),
        "bf16": dict(dtype="bf16"),
        **{f"w-{w}": dict(weights=w) for w in TOL},
    }
    jobs = [(str(tiny_gqa), str(root / name), extra) for name, extra in variants.items()]
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_export, jobs))
    return {name: root / name for name in variants}


def _teacher_forced(export, ids, lens):
    sess = Runner.load(export)
    return nxdc_logits(sess.prefill, sess.decode, ids, lens)


def _ids():
    torch.manual_seed(3)
    return torch.randint(3, 256, (2, 30)), [14, 6]


def test_cuda_fp32_logits_match_transformers_on_the_gpu(tiny_gqa, cuda_exports):
    ids, lens = _ids()
    ref = reference_logits(hf_model(tiny_gqa).cuda(), ids.cuda()).cpu()
    err = max_error(ref, _teacher_forced(cuda_exports["fp32"], ids, lens), lens)
    assert err < 1e-4, err


def test_cuda_bf16_logits_match_transformers_bf16(tiny_gqa, cuda_exports):
    ids, lens = _ids()
    ref = reference_logits(hf_model(tiny_gqa, torch.bfloat16).cuda(), ids.cuda()).cpu()
    err = max_error(ref, _teacher_forced(cuda_exports["bf16"], ids, lens), lens)
    assert err < 6e-2, err


@pytest.mark.parametrize("fmt", list(TOL))
def test_cuda_reduced_weights_stay_close_to_fp32(cuda_exports, fmt):
    ids, lens = _ids()
    want = _teacher_forced(cuda_exports["fp32"], ids, lens)
    got = _teacher_forced(cuda_exports[f"w-{fmt}"], ids, lens)
    err = max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True))
    assert 0 < err < TOL[fmt], err  # > 0: the stored format really was used


def test_cuda_speculation_reproduces_greedy(cuda_exports):
    from tiny import tiny_tokenizer

    from nxdc.generation.loop import generate
    from nxdc.generation.speculative import PromptLookup, Speculator

    sess = Runner.load(cuda_exports["fp32"])
    prompts, tok = ["w1 w2 w3 w4 w1 w2 w3", "w5 w6 w5 w6"], tiny_tokenizer()
    plain = generate(sess, tok, prompts, max_new_tokens=12, eos_ids=set())
    spec = generate(sess, tok, prompts, 12, eos_ids=set(), speculator=Speculator(PromptLookup(3), 2, sess))
    assert [s.token_ids for s in spec.sequences] == [s.token_ids for s in plain.sequences]
    assert spec.speculation["accepted"] > 0
