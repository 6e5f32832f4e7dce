"""Session-wide fixtures: a temp compile cache, tiny models and their exports (each exported
once per session and shared), and the embedded SmolLM2 export."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NXDC_TP_TIMEOUT_S", "120")  # a hung collective fails a test instead of stalling CI
warnings.filterwarnings("ignore", category=FutureWarning)

from tiny import GQA_EXPORT, SERVE_EXPORT, make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A fresh compile cache per session; NXDC_TEST_CACHE_DIR (a developer's choice, never CI's)
    keeps one across sessions, so a rerun of a few tests does not recompile their models."""
    keep = os.environ.get("NXDC_TEST_CACHE_DIR")
    d = Path(keep) if keep else tmp_path_factory.mktemp("nxdc-cache")
    d.mkdir(parents=True, exist_ok=True)
    os.environ["NXDC_CACHE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    """GQA (4 heads / 2 KV heads), untied, Llama-3 rope scaling."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"), seed=1, rope_scaling=rope)


@pytest.fixture(scope="session")
def tiny_gqa_export(tiny_gqa, cache_dir, tmp_path_factory) -> Path:
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "tiny-gqa"
    opts = ExportOptions(**GQA_EXPORT)
    run_export(str(tiny_gqa), out, opts)
    return out


@pytest.fixture(scope="session")
def tiny_serve_export(tiny_gqa, cache_dir, tmp_path_factory) -> Path:
    """The tiny GQA model with the graphs `nxdc serve` needs (tiny.SERVE_EXPORT)."""
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "tiny-serve"
    run_export(str(tiny_gqa), out, ExportOptions(**SERVE_EXPORT))
    return out


@pytest.fixture(scope="session")
def tiny_tp2_export(tiny_gqa, cache_dir, tmp_path_factory) -> Path:
    """The tiny GQA model at --tp 2, with test_tp.py's TINY_TP_EXPORT buckets (its graphs are
    cache hits when test_tp.py has run)."""
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "tiny-tp2"
    opts = ExportOptions(tp=2, batch_size=2, sequence_length=64, context_buckets=(16,), decode_buckets=(64,))
    run_export(str(tiny_gqa), out, opts)
    return out


@pytest.fixture(scope="session")
def tiny_mha_bf16_export(cache_dir, tmp_path_factory) -> tuple[Path, Path]:
    """MHA (4/4 heads), tied embeddings, exported in bf16."""
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    src = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-mha"), seed=2, num_key_value_heads=4, tie_word_embeddings=True
    )
    out = tmp_path_factory.mktemp("exports") / "tiny-mha-bf16"
    run_export(
        str(src), out, ExportOptions(batch_size=1, sequence_length=32, context_buckets=(32,), dtype="bf16")
    )
    return src, out


@pytest.fixture(scope="session")
def smollm2_export(cache_dir, tmp_path_factory) -> Path:
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "smollm2"
    run_export("smollm2-135m", out, ExportOptions(batch_size=1, sequence_length=128, context_buckets=(64,)))
    return out


@pytest.fixture(scope="session")
def smollm2_exact_export(cache_dir, tmp_path_factory, smollm2_export) -> Path:
    """``smollm2_export`` with ``--prefill-matmul exact``: its prompt graph multiplies in fp32 (the
    decode graphs are the same cache entries)."""
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "smollm2-exact"
    opts = ExportOptions(batch_size=1, sequence_length=128, context_buckets=(64,), prefill_matmul="exact")
    run_export("smollm2-135m", out, opts)
    return out


SMOLLM2_SERVE_EXPORT = dict(
    batch_size=8, sequence_length=1024, context_buckets=(64,), decode_buckets=(1024,), chunk_buckets=(32, 256)
)


@pytest.fixture(scope="session")
def smollm2_serve_export(cache_dir, tmp_path_factory) -> Path:
    """SmolLM2 with serving graphs: 8 rows of 1,024 positions."""
    from nxdc.pipeline import run_export
    from nxdc.plan import ExportOptions

    out = tmp_path_factory.mktemp("exports") / "smollm2-serve"
    run_export("smollm2-135m", out, ExportOptions(**SMOLLM2_SERVE_EXPORT))
    return out


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' own load of the same GGUF: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nxdc.weights.sources import embedded_path

    p = embedded_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return model, tok
