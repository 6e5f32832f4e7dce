"""Fast unit tests: buckets, plan validation, spec mapping, sampling filters, cache store."""

from __future__ import annotations

import json

import pytest
import torch

from nxdc.archs import spec_from_config
from nxdc.buckets import Bucket, context_buckets, pick_context_bucket
from nxdc.cache.store import CompileCache, verify_entry
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.generation.sampling import SamplingParams, filter_logits, greedy
from nxdc.generation.text import find_stop
from nxdc.spec import rope_from_config


def test_context_buckets_powers_of_two():
    assert context_buckets(1024, 128, None) == [128, 256, 512, 1024]
    assert context_buckets(1000, 128, None) == [128, 256, 512, 1000]
    assert context_buckets(64, 128, None) == [64]
    assert context_buckets(512, 100, (512, 32)) == [32, 512]
    with pytest.raises(UserInputError):
        context_buckets(64, 16, (128,))


def test_pick_context_bucket():
    bs = [Bucket("context", n) for n in (16, 64)]
    assert pick_context_bucket(bs, 1).length == 16
    assert pick_context_bucket(bs, 17).length == 64
    with pytest.raises(UserInputError, match="65 tokens.*largest context bucket of this export is 64"):
        pick_context_bucket(bs, 65)


def test_pick_decode_bucket():
    from nxdc.buckets import pick_decode_bucket

    bs = [Bucket("decode", n) for n in (256, 512, 1024)]
    assert pick_decode_bucket(bs, 0).length == 256
    assert pick_decode_bucket(bs, 255).length == 256
    assert pick_decode_bucket(bs, 256).length == 512
    assert pick_decode_bucket(bs, 1023).length == 1024
    with pytest.raises(UserInputError, match="past the sequence length 1024"):
        pick_decode_bucket(bs, 1024)


def test_rope_config_spellings():
    old = {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    new = {
        "rope_parameters": {
            "rope_theta": 500000.0,
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    }
    assert rope_from_config(old) == rope_from_config(new)
    assert rope_from_config(old).kind == "llama3"
    with pytest.raises(UnsupportedError, match="yarn"):
        rope_from_config({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nxdc.model.layers import inv_freq

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = inv_freq(spec_from_config(cfg.to_dict()).rope, 64)
    torch.testing.assert_close(got, want)


def test_spec_requires_model_type():
    with pytest.raises(UserInputError, match="model_type"):
        spec_from_config({})


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    k2 = filter_logits(logits, SamplingParams(do_sample=True, top_k=2))
    assert torch.isfinite(k2).tolist() == [[True, True, False, False, False]]
    probs = logits.softmax(-1)[0]  # 0.636, 0.234, 0.086, ...
    p = filter_logits(logits, SamplingParams(do_sample=True, top_p=float(probs[0] + probs[1]) - 1e-3))
    assert torch.isfinite(p).tolist() == [[True, True, False, False, False]]
    p1 = filter_logits(logits, SamplingParams(do_sample=True, top_p=0.01))
    assert torch.isfinite(p1).tolist() == [[True, False, False, False, False]]


def test_greedy_picks_what_torch_argmax_picks():
    torch.manual_seed(0)
    cases = [
        torch.randn(8, 49152),
        torch.randn(49152),
        torch.randn(3, 7).bfloat16(),
        torch.tensor([[2.0, 5.0, 5.0, 1.0]]),  # ties: the first
        torch.tensor([1.0, float("nan"), 3.0]),  # a NaN counts as the largest
    ]
    for x in cases:
        got = greedy(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), (x, got)


def test_find_stop():
    assert find_stop("hello world", ["wor"]) == 6
    assert find_stop("hello world", ["zzz", "o"]) == 4
    assert find_stop("hello world", []) is None


def test_cache_put_get_and_corruption(tmp_path):
    cache = CompileCache(tmp_path / "c")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt2").write_bytes(b"x" * 100)
    parts = {"bucket": "decode-8", "torch": "2.13.0", "flags": {"a": 1}}
    entry = cache.put("ns", "k1", parts, src)
    assert verify_entry(entry) is None
    assert cache.get("ns", "k1", parts).path == entry
    miss = cache.get("ns", "k2", {**parts, "torch": "2.14.0", "flags": {"a": 2}})
    assert miss.path is None and miss.reason == "differs in flags.a, torch"
    (entry / "model.pt2").write_bytes(b"y" * 100)
    look = cache.get("ns", "k1", parts)
    assert look.path is None and "sha256 mismatch" in look.reason
    assert not entry.exists()
    assert json.loads(json.dumps(list(cache.entries()))) == []


def test_sharded_safetensors_checkpoint_reads_like_single_file(tmp_path):
    from tiny import make_tiny_llama
    from transformers import AutoModelForCausalLM

    from nxdc.weights.sources import resolve

    single = make_tiny_llama(tmp_path / "single")
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = {k: t.read() for k, t in resolve(str(single)).tensors(None)}
    b = {k: t.read() for k, t in resolve(str(tmp_path / "sharded")).tensors(None)}
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_is_a_clear_error(tmp_path):
    from tiny import make_tiny_llama
    from transformers import AutoModelForCausalLM

    from nxdc.weights.safetensors_source import safetensors_files

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "single"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    next((tmp_path / "sharded").glob("model-0000*.safetensors")).unlink()
    with pytest.raises(UserInputError, match="missing"):
        safetensors_files(tmp_path / "sharded")


def test_extra_inductor_settings_are_checked_and_keyed(monkeypatch):
    from nxdc.compile.backends.inductor import InductorBackend

    backend = InductorBackend("cpu")
    plain = backend.key_parts("decode")
    monkeypatch.setenv("NXDC_INDUCTOR_CONFIG", '{"max_autotune": true}')
    tuned = backend.key_parts("decode")
    assert tuned["flags"]["max_autotune"] is True and tuned != plain
    for bad, why in (("{nope", "not valid JSON"), ("[1]", "JSON object"), ('{"no_such": 1}', "'no_such'")):
        monkeypatch.setenv("NXDC_INDUCTOR_CONFIG", bad)
        with pytest.raises(UserInputError, match=why):
            backend.inductor_configs("decode")


def test_host_arena_carves_aligned_tensors_from_one_huge_page_mapping():
    from nxdc.runtime.arena import ALIGN, HUGE, HostArena

    srcs = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int8),
        torch.randn(0, 4),
        torch.randn(2, dtype=torch.float64),
    ]
    arena = HostArena(HostArena.bytes_for(srcs) + HostArena.bytes_for([((2, 3), torch.bfloat16)]))
    assert arena._bytes.data_ptr() % HUGE == 0
    copies = [arena.copy(s) for s in srcs]
    kv = arena.zeros((2, 3), torch.bfloat16)
    for s, c in zip(srcs, copies, strict=True):
        assert torch.equal(s, c) and c.dtype == s.dtype and c.is_contiguous()
        assert c.data_ptr() % ALIGN == 0
    assert not kv.any() and kv.dtype == torch.bfloat16
    copies[0].fill_(1.0)  # views of distinct bytes: writing one leaves the others alone
    assert torch.equal(copies[1], srcs[1]) and torch.equal(copies[3], srcs[3])
    assert 0 <= arena.huge_bytes() <= arena.size
    with pytest.raises(RuntimeError, match="full"):
        arena.empty((1,), torch.float32)


def test_read_samples_keep_their_buffer():
    """`nxdc bench` samples the read bandwidth around every run; a fresh buffer freed each time
    stalled a decode step of the next run (docs/performance.md, ITL p99)."""
    from nxdc.bench import machine

    threads = torch.get_num_threads()  # it sets the thread count: keep this session's
    assert machine.read_bandwidth_gbs(threads, mib=8, reps=1) > 0
    kept = dict(machine._READ_BUFFERS)
    assert machine.read_bandwidth_gbs(threads, mib=8, reps=1) > 0
    assert machine._READ_BUFFERS.keys() == kept.keys()
    assert all(machine._READ_BUFFERS[k] is v for k, v in kept.items())
