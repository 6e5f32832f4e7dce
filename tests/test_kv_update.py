"""``--kv-update functional``: graphs write the KV cache out of place, re-assign it and return it
(the form NxD's ModelBuilder and XLA need). Eagerly and compiled with inductor, logits are
bit-identical to the in-place form's; the option is checked per backend and keyed."""

from __future__ import annotations

import json

import pytest
import torch
from parity import nxdc_logits
from test_cli import assert_error
from test_parity_eager import build
from tiny import GQA_EXPORT

from nxdc.model.decoder import ContextEncoding, FunctionalKV, TokenGeneration, kv_cache_names
from nxdc.runtime.runner import Runner


def eager_logits(model, functional: bool, ids, lens):
    """Teacher-forced logits; a functional graph's caches are written back by the caller, as a
    runtime does."""
    for name in kv_cache_names(model.spec):
        model.get_buffer(name).zero_()
    ce, tg = ContextEncoding(model), TokenGeneration(model, 32)
    if functional:
        ce, tg = FunctionalKV(ce), FunctionalKV(tg)

    def run(graph, *args):
        with torch.no_grad():
            out = graph(*args)
        if not functional:
            return out
        caches = [model.get_buffer(n) for n in kv_cache_names(model.spec)]
        for buf, new in zip(caches, out[1:], strict=True):
            assert new is not buf  # a new tensor, the buffer itself untouched until written back
            buf.copy_(new)
        return out[0]

    def prefill(prompts):
        x = torch.zeros(2, 16, dtype=torch.int64)
        for i, p in enumerate(prompts):
            x[i, : len(p)] = torch.tensor(p)
        return run(ce, x, torch.tensor([len(p) - 1 for p in prompts]))

    return nxdc_logits(prefill, lambda toks, pos: run(tg, toks.view(-1, 1), pos), ids, lens)


def test_functional_kv_is_bit_identical_eagerly():
    _, in_place_model = build("gqa", torch.float32, batch=2, max_seq=32)
    _, model = build("gqa", torch.float32, batch=2, max_seq=32, kv_update="functional")  # same weights
    torch.manual_seed(5)
    ids = torch.randint(3, 256, (2, 24))
    lens = [9, 4]
    in_place = eager_logits(in_place_model, False, ids, lens)
    before = {n: model.get_buffer(n) for n in kv_cache_names(model.spec)}
    functional = eager_logits(model, True, ids, lens)
    # FunctionalKV leaves the decoder's buffers in place: the same tensors after every call
    assert all(model.get_buffer(n) is t for n, t in before.items())
    for a, b in zip(in_place, functional, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_functional_kv_compiled_is_bit_identical(tiny_gqa, tiny_gqa_export, tmp_path):
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path / "functional"
    res = run_export(str(tiny_gqa), out, ExportOptions(**GQA_EXPORT, kv_update="functional"))
    assert res.plan.kv_update == "functional" and not any(b.hit for b in res.buckets)
    in_place_keys = {
        n: a["key"] for n, a in json.loads((tiny_gqa_export / "nxdc.json").read_text())["artifacts"].items()
    }
    assert {b.name: b.key for b in res.buckets}.keys() == in_place_keys.keys()
    assert not {b.key for b in res.buckets} & set(in_place_keys.values())  # keyed apart
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (2, 40))
    lens = [30, 7]  # prefill in bucket 32; decode crosses from the 32-slot to the 64-slot graph
    a, b = Runner.load(tiny_gqa_export), Runner.load(out)
    ref = nxdc_logits(a.prefill, a.decode, ids, lens)
    got = nxdc_logits(b.prefill, b.decode, ids, lens)
    for x, y in zip(ref, got, strict=True):
        assert torch.equal(x, y)
    for name in kv_cache_names(b.spec):  # the caches the runtime holds were written back
        full = "model." + name
        assert torch.equal(a.session.constants[full], b.session.constants[full])


def test_kv_update_is_checked_per_backend(tiny_gqa, tmp_path):
    o = str(tmp_path / "x")
    assert_error(
        ["export", tiny_gqa, "-o", o, "--kv-update", "sideways", "--dry-run"], 2, "--kv-update sideways"
    )
    assert_error(
        ["export", tiny_gqa, "-o", o, "--backend", "xla", "--kv-update", "in-place", "--dry-run"],
        2,
        "the xla backend writes the KV cache functional",
    )
    assert_error(
        ["export", tiny_gqa, "-o", o, "--backend", "xla", "--tp", "2", "--dry-run"], 2, "tensor parallelism"
    )


def test_xla_backend_without_torch_xla_says_how_to_get_it(tiny_gqa, tmp_path):
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch-xla is installed here (make test-xla covers the backend)")
    assert_error(
        ["export", tiny_gqa, "-o", tmp_path / "x", "--backend", "xla"], 2, "needs torch-xla", "make test-xla"
    )
    assert not (tmp_path / "x").exists()
