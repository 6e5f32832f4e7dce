"""Every supported architecture (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe) against
Hugging Face transformers on tiny random checkpoints.

- Eager (no compile, seconds): logits at tp 1/2 (MoE also 3/4) x fp32/bf16, through the
  exporter's own per-rank weight files (``write_weights``: name mapping, fusing, expert
  stacking, sharding). The ranks of a tp > 1 model run as threads of this process whose
  all-reduce sums the ranks' tensors (``ThreadGroup``); greedy 16 tokens in fp32.
- Compiled (``slow``): Mixtral fp32 and Qwen3-MoE bf16 exported at tp 2 and run by the real
  runtime (one worker process, gloo), Qwen2 fp32 at tp 1: logits, and greedy text (fp32).
- Config mapping, weight names, the MoE block's three paths, the sliding-window refusal, the
  CLI's list of supported architectures and ``--config-only`` plans of the shipped presets.

Tolerances (max abs logit error vs transformers, logits of magnitude ~2.5, 2 layers):
fp32 2e-5 (the same math in another order); bf16 6e-2 (8-bit mantissas through two layers).
bf16 MoE: where two experts' routing probabilities nearly tie, bf16 rounding decides which one
is chosen in *any* implementation, and a flip moves that token's logits by ~0.5. Such prompts
have no single right answer, so MoE tests draw prompts whose reference routing has a top-k
margin of at least ``ROUTING_MARGIN`` at every token and layer (``clear_prompt``; chosen from
the reference alone) and then hold every position to the plain tolerance.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from parity import hf_greedy, max_error, nxdc_logits, reference_logits
from safetensors.torch import load_file
from tiny import TINY_ARCHS, make_tiny, tiny_config, tiny_tokenizer
from typer.testing import CliRunner

from nxdc.archs import get_arch, spec_from_config, supported
from nxdc.cli.main import app
from nxdc.compile.planning import make_plan
from nxdc.errors import UnsupportedError, UserInputError
from nxdc.model.decoder import ContextEncoding, Decoder, TokenGeneration
from nxdc.model.moe import MoE
from nxdc.model.sharding import shard_layout
from nxdc.pipeline import run_export, write_weights
from nxdc.plan import ExportOptions
from nxdc.weights.shard import tied_lm_head
from nxdc.weights.sources import resolve

ARCHS = sorted(TINY_ARCHS)
MOE = ("mixtral", "qwen3_moe")
TOL = {"fp32": 2e-5, "bf16": 6e-2}
ROUTING_MARGIN = 2e-3  # top-k routing prob margin; bf16 rounding moves router probs by ~5e-4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH, MAX_SEQ, CTX = 2, 32, 16
LENS = [9, 5]  # prompt lengths; the rest of each 20-token row is decoded one token at a time
TINY_EXPORT = dict(
    batch_size=BATCH, sequence_length=MAX_SEQ, context_buckets=(CTX,), decode_buckets=(MAX_SEQ,)
)
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), seed=3)
        return made[arch]

    return get


_HF: dict[tuple[Path, str], torch.nn.Module] = {}


def hf_model(path: Path, dtype: str):
    """transformers' model of a tiny checkpoint; MoE experts use transformers' plain loop."""
    from transformers import AutoModelForCausalLM

    if (path, dtype) not in _HF:
        _HF[(path, dtype)] = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], experts_implementation="eager"
        ).eval()
    return _HF[(path, dtype)]


def routing_margins(hf, ids: torch.Tensor) -> torch.Tensor:
    """Per row of ``ids``: the smallest gap between the k-th and (k+1)-th routing probability
    of transformers' routers over the row's tokens and every layer (inf for a dense model)."""
    k = getattr(hf.config, "num_experts_per_tok", None)
    if k is None:
        return torch.full((ids.shape[0],), float("inf"))
    probs = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: probs.append(torch.softmax(o[0].float(), -1)))
        for layer in hf.model.layers
    ]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for h in hooks:
            h.remove()
    top = torch.stack(probs).topk(k + 1, dim=-1).values  # [layers, rows * T, k + 1]
    gap = (top[..., k - 1] - top[..., k]).view(len(probs), *ids.shape)
    return gap.amin(dim=(0, 2))


_PROMPTS: dict[int, torch.Tensor] = {}


def clear_prompt(hf, rows: int = BATCH, length: int = 20) -> torch.Tensor:
    """Random token ids whose rows have no routing near-tie in the reference (any ids for a
    dense model). Rows are independent, so candidates are screened 128 at a time."""
    if id(hf) not in _PROMPTS:
        _PROMPTS[id(hf)] = _clear_prompt(hf, rows, length)
    return _PROMPTS[id(hf)]


def _clear_prompt(hf, rows: int, length: int) -> torch.Tensor:
    found = []
    for seed in range(1, 30):
        cand = torch.randint(3, 256, (128, length), generator=torch.Generator().manual_seed(seed))
        found += [row for row, m in zip(cand, routing_margins(hf, cand), strict=True) if m >= ROUTING_MARGIN]
        if len(found) >= rows:
            return torch.stack(found[:rows])
    raise AssertionError("no prompt without a routing near-tie in 3712 draws")


class ThreadGroup:
    """``tp`` ranks as threads of this process: every collective waits for all ranks' tensors
    and returns their sum (in rank order), standing in for the graphs' all-reduce."""

    def __init__(self, tp: int):
        self.tp = tp
        self.slots: list[torch.Tensor | None] = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=60)
        self.local = threading.local()

    def all_reduce(self, x: torch.Tensor, tp: int) -> torch.Tensor:
        if tp == 1:
            return x
        self.slots[self.local.rank] = x
        self.barrier.wait()
        out = self.slots[0].clone()
        for s in self.slots[1:]:
            out = out + s
        self.barrier.wait()  # nobody overwrites a slot before every rank has summed
        return out

    def _run(self, rank: int, fn):
        self.local.rank = rank
        try:
            return fn(rank)
        except BaseException:
            self.barrier.abort()
            raise

    def run(self, fn) -> list:
        if self.tp == 1:
            return [fn(0)]
        with ThreadPoolExecutor(self.tp) as ex:
            return [f.result() for f in [ex.submit(self._run, r, fn) for r in range(self.tp)]]


class EagerRanks:
    """nxdc's decoder, one per rank, loaded from the rank weight files the exporter writes."""

    def __init__(self, ckpt: Path, dtype: str, tp: int, tmp: Path, monkeypatch):
        src = resolve(str(ckpt))
        spec = spec_from_config(src.config())
        plan = make_plan(spec, ExportOptions(tp=tp, dtype=dtype, **TINY_EXPORT))
        layout = shard_layout(spec, tp)
        self.group = ThreadGroup(tp)
        for mod in ("nxdc.model.attention", "nxdc.model.decoder", "nxdc.model.parallel"):
            monkeypatch.setattr(f"{mod}.all_reduce", self.group.all_reduce)
        self.ranks = []
        for rank in range(tp):
            path = tmp / f"rank{rank}.safetensors"
            write_weights(src, spec, plan, rank, path)
            sd = load_file(path)
            if spec.tie_word_embeddings and tp > 1:
                sd["lm_head.weight"] = tied_lm_head(sd["embed_tokens.weight"], layout, rank)
            model = Decoder(spec, BATCH, MAX_SEQ, DTYPES[dtype], layout=layout).eval()
            result = model.load_state_dict(sd, strict=False)
            assert not result.unexpected_keys, result.unexpected_keys
            assert all(k.endswith("_cache") or k == "lm_head.weight" for k in result.missing_keys), result
            if tp > 1:
                model.tp_rank.fill_(rank)
            self.ranks.append((ContextEncoding(model), TokenGeneration(model, MAX_SEQ)))

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        x = torch.zeros(BATCH, CTX, dtype=torch.int64)
        last = torch.tensor([len(p) - 1 for p in prompts] + [0] * (BATCH - len(prompts)))
        for i, p in enumerate(prompts):
            x[i, : len(p)] = torch.tensor(p)
        with torch.no_grad():
            return self.group.run(lambda r: self.ranks[r][0](x, last))[0]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.group.run(lambda r: self.ranks[r][1](tokens.view(-1, 1), positions))[0]


def greedy(run, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt (EOS ignored) with prefill/decode callables."""
    out = [[] for _ in prompts]
    nxt = run.prefill(prompts).argmax(-1)
    pos = torch.tensor([len(p) for p in prompts])
    for step in range(new_tokens):
        for i in range(len(prompts)):
            out[i].append(int(nxt[i]))
        if step + 1 < new_tokens:
            nxt = run.decode(nxt, pos).argmax(-1)
            pos = pos + 1
    return out


# --- eager parity -------------------------------------------------------------------------


def _cases():
    for arch in ARCHS:
        for dtype in DTYPES:
            for tp in (1, 2, 3, 4) if arch in MOE and dtype == "fp32" else (1, 2):
                yield pytest.param(arch, dtype, tp, id=f"{arch}-{dtype}-tp{tp}")


@pytest.mark.parametrize("arch, dtype, tp", list(_cases()))
def test_eager_logits_match_transformers(arch, dtype, tp, tiny_ckpt, tmp_path, monkeypatch):
    ckpt = tiny_ckpt(arch)
    hf = hf_model(ckpt, dtype)
    ids = clear_prompt(hf)
    ref = reference_logits(hf, ids)
    ours = EagerRanks(ckpt, dtype, tp, tmp_path, monkeypatch)
    err = max_error(ref, nxdc_logits(ours.prefill, ours.decode, ids, LENS), LENS)
    print(f"\n{arch} tp {tp} {dtype}: max abs logit error {err:.2e}")
    assert err < TOL[dtype], f"{arch} tp {tp} {dtype}: max abs logit error {err}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_eager_greedy_matches_transformers(arch, tp, tiny_ckpt, tmp_path, monkeypatch):
    ckpt = tiny_ckpt(arch)
    hf = hf_model(ckpt, "fp32")
    ours = EagerRanks(ckpt, "fp32", tp, tmp_path, monkeypatch)
    prompts = [[1, 17, 42, 99, 5, 230, 64], [1, 8]]
    got = greedy(ours, prompts, 16)
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(hf, torch.tensor([p]), 16, pad_token_id=0), (arch, tp, p)


# --- compiled end to end (tp 2: one worker process, gloo) -----------------------------------
# One context and one decode bucket per export (2 graphs, ~30 s each on 2 cores).


@pytest.fixture(scope="module")
def arch_exports(tiny_ckpt, cache_dir, tmp_path_factory):
    made: dict[tuple[str, str, int], Path] = {}

    def get(arch: str, dtype: str, tp: int) -> Path:
        key = (arch, dtype, tp)
        if key not in made:
            out = tmp_path_factory.mktemp("exports") / f"{arch}-{dtype}-tp{tp}"
            run_export(str(tiny_ckpt(arch)), out, ExportOptions(tp=tp, dtype=dtype, **TINY_EXPORT))
            made[key] = out
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, dtype, tp", [("mixtral", "fp32", 2), ("qwen3_moe", "bf16", 2), ("qwen2", "fp32", 1)]
)
def test_compiled_matches_transformers(arch, dtype, tp, tiny_ckpt, arch_exports):
    from nxdc.generation.loop import generate
    from nxdc.runtime.workers import open_runner

    ckpt = tiny_ckpt(arch)
    hf = hf_model(ckpt, dtype)
    ids = clear_prompt(hf)
    ref = reference_logits(hf, ids)
    out = arch_exports(arch, dtype, tp)
    sess = open_runner(out)
    try:
        err = max_error(ref, nxdc_logits(sess.prefill, sess.decode, ids, LENS), LENS)
        print(f"\ncompiled {arch} tp {tp} {dtype}: max abs logit error {err:.2e}")
        assert err < TOL[dtype], err
        if dtype == "fp32":  # greedy text through the real generation loop, batch 2
            tok = tiny_tokenizer()  # transformers>=5 loads a qwen2 dir's copy as Qwen2Tokenizer
            prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8"]
            res = generate(sess, tok, prompts, max_new_tokens=16, eos_ids=set())
            for prompt, seq in zip(prompts, res.sequences, strict=True):
                p = tok(prompt, return_tensors="pt").input_ids
                assert seq.token_ids == hf_greedy(hf, p, 16, pad_token_id=0), prompt
    finally:
        sess.close()


# --- config mapping, weight names, MoE paths ------------------------------------------------


def test_config_mapping():
    spec = {a: spec_from_config(tiny_config(a).to_dict()) for a in ARCHS}
    assert spec["qwen2"].qkv_bias and not spec["qwen2"].attention_bias
    assert spec["qwen3"].qk_norm and spec["qwen3_moe"].qk_norm and not spec["llama"].qk_norm
    assert (spec["mixtral"].num_experts, spec["mixtral"].experts_per_token) == (8, 2)
    assert spec["mixtral"].moe_intermediate_size == 96 and spec["mixtral"].norm_topk_prob
    assert (spec["qwen3_moe"].num_experts, spec["qwen3_moe"].moe_intermediate_size) == (8, 80)
    assert not spec["qwen3_moe"].norm_topk_prob
    assert spec["mistral"].sliding_window == 64 and spec["llama"].sliding_window is None
    # the window counts only when some layer uses it
    assert spec_from_config(tiny_config("mistral", sliding_window=None).to_dict()).sliding_window is None
    q = json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text())
    assert spec_from_config({**q, "sliding_window": 4096}).sliding_window is None  # use_sliding_window false
    on = {**q, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 30}
    assert spec_from_config(on).sliding_window == 4096
    assert spec_from_config({**on, "max_window_layers": 36}).sliding_window is None  # no layer slides
    # the published configs' own spellings (transformers < 5)
    mixtral = spec_from_config(json.loads((CONFIGS / "mixtral-8x7b" / "config.json").read_text()))
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.sliding_window) == (8, 2, None)


def test_bad_moe_configs_are_clear_errors():
    cfg = tiny_config("qwen3_moe").to_dict()
    with pytest.raises(UnsupportedError, match="mlp_only_layers"):
        spec_from_config({**cfg, "mlp_only_layers": [0]})
    with pytest.raises(UnsupportedError, match="between 1 and 8"):
        spec_from_config({**cfg, "num_experts_per_tok": 9})
    bad = tiny_config("mixtral").to_dict()
    del bad["num_local_experts"]
    with pytest.raises(UserInputError, match="num_local_experts"):
        spec_from_config(bad)


def test_weight_names():
    mixtral, qwen = get_arch("mixtral"), get_arch("qwen3_moe")
    assert mixtral.weight_name("model.layers.3.block_sparse_moe.gate.weight") == "layers.3.mlp.router.weight"
    assert (
        mixtral.weight_name("model.layers.3.block_sparse_moe.experts.7.w3.weight")
        == "layers.3.mlp.experts.7.up_proj.weight"
    )
    assert mixtral.weight_name("model.layers.0.block_sparse_moe.experts.0.w2.weight").endswith(
        "0.down_proj.weight"
    )
    assert qwen.weight_name("model.layers.1.mlp.gate.weight") == "layers.1.mlp.router.weight"
    assert (
        qwen.weight_name("model.layers.1.mlp.experts.5.gate_proj.weight")
        == "layers.1.mlp.experts.5.gate_proj.weight"
    )
    assert (
        get_arch("qwen3").weight_name("model.layers.0.self_attn.q_norm.weight")
        == "layers.0.self_attn.q_norm.weight"
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_paths_agree(dtype):
    """The grouped, gather and dense expert paths compute the same block (to rounding)."""
    spec = spec_from_config(tiny_config("qwen3_moe", norm_topk_prob=True).to_dict())
    torch.manual_seed(0)
    moe = MoE(spec, shard_layout(spec, 1), DTYPES[dtype])
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(3, 5, spec.hidden_size).to(DTYPES[dtype])
        paths = ["gather", "dense"] + (["grouped"] if dtype == "bf16" else [])
        outs = {p: moe(x, path=p).float() for p in paths}
    # 8 experts, top 3: gather up to 5 tokens (15 pairs <= 2 * 8)
    assert [moe.path(n, torch.float32) for n in (1, 5, 6, 512)] == ["gather", "gather", "dense", "dense"]
    assert [moe.path(n, torch.bfloat16) for n in (1, 6, 512)] == ["gather", "grouped", "grouped"]
    assert moe.path(1, torch.bfloat16, "cuda") == "grouped"
    # _grouped_mm needs 16-byte rows: an expert size of 20 per rank falls back
    odd = MoE(spec, shard_layout(spec, 4), torch.bfloat16, device="meta")
    assert odd.path(1, torch.bfloat16, "cuda") == "gather" and odd.path(16, torch.bfloat16) == "dense"
    tol = 1e-6 if dtype == "fp32" else 1e-2
    for p in paths[1:]:
        assert (outs[p] - outs["gather"]).abs().max().item() < tol, p


# --- plan and CLI ---------------------------------------------------------------------------


def test_gguf_of_other_archs_refused(tmp_path):
    """GGUF names and llama.cpp's q/k permutation are mapped for Llama only: a Qwen GGUF would
    load wrongly, so it is refused before any tensor is read."""
    from nxdc.weights.sources import ModelSource

    spec = spec_from_config(tiny_config("qwen2").to_dict())
    plan = make_plan(spec, ExportOptions(**TINY_EXPORT))
    src = ModelSource("gguf", tmp_path / "m.gguf", "m.gguf")
    with pytest.raises(UnsupportedError, match="GGUF files of qwen2 models are not supported"):
        write_weights(src, spec, plan, 0, tmp_path / "rank0.safetensors")


def test_sliding_window_refused_in_plan():
    spec = spec_from_config(tiny_config("mistral", sliding_window=48).to_dict())
    with pytest.raises(
        UserInputError, match=r"--sequence-length 64 exceeds the model's sliding_window \(48\)"
    ):
        make_plan(spec, ExportOptions(sequence_length=64))
    assert make_plan(spec, ExportOptions(sequence_length=48)).sequence_length == 48
    assert make_plan(spec, ExportOptions()).sequence_length == 48  # the default stays inside it
    spec = spec_from_config(tiny_config("mistral", sliding_window=None).to_dict())
    assert make_plan(spec, ExportOptions(sequence_length=512)).sequence_length == 512


runner = CliRunner()


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


def test_cli_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    code, out, err = cli("export", tmp_path / "m", "-o", tmp_path / "o")
    assert code == 2 and "Traceback" not in out + err
    assert "unsupported architecture 'gpt_neox'; supported: " + ", ".join(supported()) in err
    assert set(ARCHS) <= set(supported())


def test_cli_sliding_window_refusal(tiny_ckpt, tmp_path):
    cfg = tiny_config("mistral", sliding_window=16).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli("export", "--config-only", tmp_path / "config.json", "--sequence-length", "32")
    assert code == 2 and err.startswith("error:") and "sliding_window (16)" in err, err


# preset -> (model_type, tp, params, per-rank weight bytes, per-rank KV-cache bytes); bf16,
# batch 4, 8192 positions (docs/architectures.md). Params match the published counts.
PRESETS = {
    "llama3.1-8b-tp8": ("llama", 8, 8_030_261_248, 2_927_370_240, 536_870_912),
    "mixtral-8x7b-tp8": ("mixtral", 8, 46_702_792_704, 11_907_375_104, 536_870_912),
    "qwen3-8b-tp4": ("qwen3", 4, 8_190_735_360, 5_029_324_800, 1_207_959_552),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_config_only_dry_run(preset, tmp_path):
    arch, tp, params, rank_w, rank_kv = PRESETS[preset]
    model_dir = CONFIGS / preset.rsplit("-tp", 1)[0]
    code, out, err = cli(
        "export", "--config", CONFIGS / f"{preset}.toml", "--config-only", model_dir / "config.json", "--json"
    )
    assert code == 0, err
    s = json.loads(out)
    assert (s["arch"], s["plan"]["tp"], s["params"], s["config_only"]) == (arch, tp, params, True)
    assert (s["plan"]["dtype"], s["plan"]["device"], s["plan"]["batch_size"]) == ("bf16", "cuda", 4)
    assert (s["sharding"]["rank_weight_bytes"], s["sharding"]["rank_kv_cache_bytes"]) == (rank_w, rank_kv)
    if arch == "mixtral":  # 12.9B active: 2 of 8 experts; each expert 14336 / 8 columns per rank
        assert s["moe"] == {
            "experts": 8,
            "experts_per_token": 2,
            "active_params": 12_879_925_248,
            "expert_intermediate_per_rank": 1792,
        }
    # the human-readable plan, and a config.json given as MODEL
    code, out, err = cli("export", model_dir / "config.json", "--dry-run", "--tp", str(tp))
    assert code == 0, err
    assert "per rank: weights" in err and "planned from config.json alone" in err


def test_config_only_errors(tmp_path):
    code, out, err = cli("export", "--config-only", tmp_path / "nope.json")
    assert code == 2 and "does not exist" in err
    (tmp_path / "bad.json").write_text("{")
    code, out, err = cli("export", "--config-only", tmp_path / "bad.json")
    assert code == 2 and "not valid JSON" in err
    code, out, err = cli("export", "smollm2-135m")
    assert code == 2 and "missing -o/--output" in err
