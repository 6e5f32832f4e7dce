"""``nxdc.load`` / ``Model`` / ``Completion`` / ``NxdcModelForCausalLM``: the Python API over an
export gives what ``nxdc generate`` gives (it is the layer the command is made of), owns its
worker processes, refuses what it cannot do with the command's messages; the transformers-style
class returns transformers' own tensor; examples/python_api.py runs."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import os
import pydoc
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

import nxdc
from nxdc.api.model import GenerateOptions, Stream
from nxdc.cli.main import app
from nxdc.errors import NxdcError, UserInputError

EXAMPLE = Path(__file__).parent.parent / "examples" / "python_api.py"
PUBLIC = ["load", "Model", "Completion", "NxdcModelForCausalLM"]
LONG = " ".join(f"w{i}" for i in range(40))  # 40 tokens: over the tiny export's largest bucket (32)
cli = CliRunner()


def cli_json(export_dir, *args) -> dict:
    res = cli.invoke(app, ["generate", str(export_dir), *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def cli_error(args) -> str:
    """The one line ``nxdc`` prints for bad input, less its ``error: ``."""
    res = cli.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: "), res.stderr
    return res.stderr.removeprefix("error: ").strip()


def test_public_names_docs_and_cheap_import():
    """The names are public, documented, and resolving them loads no torch."""
    code = f"import sys, nxdc; [getattr(nxdc, n) for n in {PUBLIC}]; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stdout + res.stderr
    for name in PUBLIC:
        assert name in nxdc.__all__ and getattr(nxdc, name).__doc__, name
    for fn in (
        nxdc.Model.generate,
        nxdc.Model.stream,
        nxdc.Model.close,
        nxdc.Completion.to_dict,
        nxdc.NxdcModelForCausalLM.from_pretrained,
        nxdc.NxdcModelForCausalLM.generate,
    ):
        assert fn.__doc__ and len(fn.__doc__) > 60, fn
    helped = pydoc.render_doc(nxdc.load)
    assert "context manager" in helped and "threads" in helped and "ExportDirError" in helped
    # every option of generate / stream is a keyword in their signatures, with its default
    for method in (nxdc.Model.generate, nxdc.Model.stream):
        params = inspect.signature(method).parameters
        for f in dataclasses.fields(GenerateOptions):
            assert (
                params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == f.default
            )
    assert "temperature: float = 0.0" in pydoc.render_doc(nxdc.Model.generate)


def test_example_imports_only_public_names():
    """examples/python_api.py uses nxdc's public names and the standard library, nothing else."""
    tree = ast.parse(EXAMPLE.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                assert a.name == "nxdc" or a.name.split(".")[0] in sys.stdlib_module_names, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.module == "nxdc":
                assert all(a.name in nxdc.__all__ for a in node.names)
            else:
                assert node.module == "__future__" or node.module.split(".")[0] in sys.stdlib_module_names
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "nxdc":
            assert node.attr in nxdc.__all__, node.attr


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-1.0), "--temperature must be > 0 (got -1.0)"),
        (dict(do_sample=True, temperature=0), "--temperature must be > 0"),
        (dict(top_p=1.5), "--top-p must be in (0, 1]"),
        (dict(top_k=-1), "--top-k must be >= 0"),
        (dict(prompt_lookup=2, draft="d"), "pick one"),
        (dict(speculation_length=2), "--speculation-length needs --draft or --prompt-lookup"),
    ],
)
def test_options_are_checked_when_made(kwargs, needle):
    with pytest.raises(UserInputError) as e:
        GenerateOptions(**kwargs)
    assert needle in str(e.value)


def test_sampling_follows_temperature():
    assert not GenerateOptions().sampling.do_sample
    assert GenerateOptions(temperature=0.7).sampling.do_sample
    assert not GenerateOptions(temperature=0.7, do_sample=False).sampling.do_sample
    assert GenerateOptions(stop="x").stop == ("x",)


@pytest.fixture(scope="module")
def tiny_model(tiny_gqa_export):
    with nxdc.load(tiny_gqa_export) as llm:
        yield llm


@pytest.mark.slow
def test_tiny_round_trip_matches_the_cli(tiny_model, tiny_gqa_export):
    llm = tiny_model
    prompts = ["w1 w2 w3", "w4"]
    want = cli_json(tiny_gqa_export, "-p", prompts[0], "-p", prompts[1], "-n", "6")
    done = llm.generate(prompts, max_new_tokens=6)
    assert all(isinstance(c, nxdc.Completion) for c in done)
    assert [c.to_dict() for c in done] == want["results"]
    assert set(done[0].batch_stats) == set(want["stats"])
    for c in done:
        assert c.finish_reason in ("stop", "length") and c.stop_reason in ("eos", "stop", "length", "max_seq")
        assert 0 < c.ttft_s <= c.total_s and c.decode_tokens_per_s >= 0
    # token ids in: the same tokens out
    ids = [llm.tokenizer(p)["input_ids"] for p in prompts]
    assert [c.token_ids for c in llm.generate(ids, max_new_tokens=6)] == [c.token_ids for c in done]
    assert llm.generate(ids[0], max_new_tokens=6)[0].token_ids == done[0].token_ids
    # streaming: the pieces make the text, and its completion is generate's
    stream = llm.stream(prompts[0], max_new_tokens=6)
    assert isinstance(stream, Stream)
    assert "".join(stream) == done[0].text and stream.completion.token_ids == done[0].token_ids
    # sampling with a seed draws what the CLI draws
    flags = ["--do-sample", "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "7"]
    sampled = cli_json(tiny_gqa_export, "-p", prompts[0], "-n", "12", *flags)["results"][0]
    mine = llm.generate(prompts[0], max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    assert mine[0].token_ids == sampled["token_ids"]
    # a stream closed early leaves the model ready for the next call
    stream = llm.stream(prompts[0], max_new_tokens=40)
    next(stream)
    stream.close()
    assert llm.generate(prompts, max_new_tokens=6)[0].token_ids == done[0].token_ids
    assert llm.manifest.plan.batch_size == llm.batch_size == 2 and llm.sequence_length == 64
    assert llm.config["model_type"] == "llama" and llm.tokenizer.eos_token == "</s>"


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompts, kwargs, flags",
    [
        ("w1 w2", dict(do_sample=True, temperature=0.0), ["--do-sample", "--temperature", "0"]),
        ("w1 w2", dict(temperature=-1.0), ["--do-sample", "--temperature", "-1"]),
        ("w1 w2", dict(top_p=1.5), ["--top-p", "1.5"]),
        ("w1 w2", dict(max_new_tokens=0), ["-n", "0"]),
        ("w1 w2", dict(chat=True), ["--chat"]),
        ("w1 w2", dict(prompt_lookup=2), ["--prompt-lookup", "2"]),
        ("w1 w2", dict(speculation_length=2), ["--speculation-length", "2"]),
        (LONG, {}, []),
        (["w1", "w2", "w3"], {}, []),
        ("", {}, []),
    ],
)
def test_bad_arguments_raise_the_cli_messages(tiny_model, tiny_gqa_export, prompts, kwargs, flags):
    with pytest.raises(UserInputError) as e:
        tiny_model.generate(prompts, **kwargs)
    given = [prompts] if isinstance(prompts, str) else prompts
    args = ["generate", tiny_gqa_export, *(x for p in given for x in ("-p", p)), *flags]
    assert str(e.value) == cli_error(args)
    if isinstance(prompts, str):  # stream checks the same, before the first piece
        with pytest.raises(UserInputError, match=re.escape(str(e.value))):
            tiny_model.stream(prompts, **kwargs)


def test_load_refuses_what_the_cli_refuses(tmp_path):
    with pytest.raises(UserInputError) as e:
        nxdc.load(tmp_path)
    assert "is not an nxdc export" in str(e.value) and str(e.value) == cli_error(
        ["generate", tmp_path, "-p", "w1"]
    )
    with pytest.raises(UserInputError) as e:
        nxdc.load(tmp_path, threads=0)
    assert str(e.value) == cli_error(["generate", tmp_path, "-p", "w1", "--threads", "0"])


@pytest.mark.slow
def test_closed_model_refuses_and_close_is_idempotent(tiny_gqa_export):
    llm = nxdc.load(tiny_gqa_export)
    assert llm.generate("w1", max_new_tokens=2)[0].token_ids
    llm.close()
    llm.close()
    with pytest.raises(NxdcError, match="is closed"):
        llm.generate("w1")
    assert "closed" in repr(llm)


def _workers() -> list[int]:
    """The pids of this process's tensor-parallel workers."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "nxdc.runtime.workers" in " ".join(p.cmdline()):
                found.append(p.pid)
    return found


def _left_behind(pids: list[int], timeout_s: float = 30) -> list[int]:
    """Those of ``pids`` that still exist (running, or exited but not reaped) once the deadline
    has passed or none does."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if psutil.pid_exists(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.slow
def test_tp2_context_manager_leaves_no_worker(tiny_tp2_export):
    assert not _workers()
    with nxdc.load(tiny_tp2_export) as llm:
        pids = _workers()
        assert len(pids) == 1 and llm.manifest.plan.tp == 2
        done = llm.generate(["w1 w2 w3", "w4"], max_new_tokens=6)
        assert [len(c.token_ids) for c in done] == [6, 6]
    assert not _left_behind(pids)
    llm.close()  # idempotent after the block
    with pytest.raises(RuntimeError, match="boom"), nxdc.load(tiny_tp2_export) as llm:
        pids = _workers()
        assert len(pids) == 1
        next(llm.stream("w1 w2", max_new_tokens=20))
        raise RuntimeError("boom")  # mid-stream: ranks in step, the workers get a polite STOP
    assert not _left_behind(pids)
    with pytest.raises(UserInputError, match="largest context bucket"), nxdc.load(tiny_tp2_export) as llm:
        pids = _workers()
        llm.generate(LONG)
    assert pids and not _left_behind(pids)


def _hf_greedy(model_cls, path, prompts, **kwargs):
    """The same code for transformers' AutoModelForCausalLM and nxdc's class: a left-padded
    batch with its attention mask, greedy."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token, tok.padding_side = "<unk>", "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    model = model_cls.from_pretrained(path)
    try:
        return model.generate(
            enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            **kwargs,
        )
    finally:
        getattr(model, "close", lambda: None)()


@pytest.mark.slow
def test_transformers_style_generate_matches_transformers(tiny_gqa, tiny_gqa_export, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    prompts = ["w5 w6 w7 w8 w9 w10", "w3"]  # a left-padded batch: 6 and 1 tokens
    theirs = _hf_greedy(AutoModelForCausalLM, tiny_gqa, prompts)
    ours = _hf_greedy(nxdc.NxdcModelForCausalLM, tiny_gqa_export, prompts)
    assert ours.dtype == torch.long and torch.equal(ours, theirs), (ours, theirs)
    # an EOS id that ends row 0 early: the EOS kept, then padding (pad_token_id 0), as transformers does
    eos = int(theirs[0, 6 + 3])
    theirs = _hf_greedy(AutoModelForCausalLM, tiny_gqa, prompts, eos_token_id=eos)
    ours = _hf_greedy(nxdc.NxdcModelForCausalLM, tiny_gqa_export, prompts, eos_token_id=eos)
    assert torch.equal(ours, theirs), (ours, theirs)
    first = (ours[0, 6:] == eos).nonzero()[0, 0]
    assert first < ours.shape[1] - 7 and (ours[0, 7 + first :] == 0).all()
    # a TextStreamer prints what it prints under transformers
    printed = []
    for cls, path in ((AutoModelForCausalLM, tiny_gqa), (nxdc.NxdcModelForCausalLM, tiny_gqa_export)):
        tok = AutoTokenizer.from_pretrained(path)
        model = cls.from_pretrained(path)
        ids = tok(["w1 w2 w3"], return_tensors="pt")["input_ids"]
        model.generate(ids, max_new_tokens=8, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
        printed.append(capsys.readouterr().out)
        getattr(model, "close", lambda: None)()
    assert printed[0] == printed[1] and len(printed[0].split()) == 8, printed


@pytest.mark.slow
def test_transformers_style_refuses_what_it_does_not_implement(tiny_gqa_export):
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor([[4, 5, 6]])
    with nxdc.NxdcModelForCausalLM.from_pretrained(tiny_gqa_export) as model:
        for kwargs, named in [
            (dict(num_beams=2), "num_beams=2"),
            (dict(repetition_penalty=1.3), "repetition_penalty=1.3"),
            (dict(no_repeat_ngram_size=3), "no_repeat_ngram_size=3"),
            (dict(output_scores=True, return_dict_in_generate=True), "return_dict_in_generate=True"),
            (dict(assistant_model=object()), "assistant_model"),
            (dict(generation_config=GenerationConfig(num_beams=4)), "num_beams=4"),
        ]:
            with pytest.raises(UserInputError, match=re.escape(named)):
                model.generate(ids, max_new_tokens=2, **kwargs)
        # transformers' defaults: max_length 20 in all
        assert model.generate(ids, do_sample=False, eos_token_id=None).shape == (1, 20)
        sampled = [model.generate(ids, do_sample=True, max_new_tokens=6) for _ in range(2)]
        torch.manual_seed(3)
        again = model.generate(ids, do_sample=True, max_new_tokens=6)
        torch.manual_seed(3)
        assert torch.equal(model.generate(ids, do_sample=True, max_new_tokens=6), again)
        assert sampled[0].shape[1] <= 9
    with pytest.raises(UserInputError, match="torch_dtype"):
        nxdc.NxdcModelForCausalLM.from_pretrained(tiny_gqa_export, torch_dtype="float16")


@pytest.mark.slow
def test_smollm2_round_trip_matches_the_cli(smollm2_export):
    prompt = "What is the capital of France?"
    want = cli_json(smollm2_export, "-p", prompt, "--chat", "-n", "12")["results"][0]
    with nxdc.load(smollm2_export) as llm:
        [done] = llm.generate(prompt, chat=True, max_new_tokens=12)
        assert done.to_dict() == want and "Paris" in done.text
        stream = llm.stream(prompt, chat=True, max_new_tokens=12)
        assert "".join(stream) == done.text and stream.completion.token_ids == done.token_ids


@pytest.mark.slow
def test_example_script(smollm2_export, cache_dir, tmp_path):
    """examples/python_api.py runs as CI's own check of the documented API: its export is the
    session's SmolLM2 export (same options), so every graph comes from the session's cache."""
    env = {**os.environ, "NXDC_CACHE_DIR": str(cache_dir)}
    res = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path / "smol")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert re.search(r"exported \S+: 2 graphs from the cache, 0 compiled", out), out
    with nxdc.load(smollm2_export) as llm:
        greedy = llm.generate("The capital of France is", max_new_tokens=16)[0].text
        sampled = llm.generate(
            "Once upon a time", max_new_tokens=24, temperature=0.8, top_p=0.9, seed=1, stop=["\n"]
        )[0].text
    assert f"greedy: {greedy!r}\n" in out and f"sampled: {sampled!r}\n" in out, out
    chat = re.search(r"^chat: (.+?)\n  stop \(eos\), \d+ tokens$", out, re.M | re.S)
    assert chat and len(chat.group(1)) > 10, out
    assert "refused: prompt has 81 tokens but the largest context bucket of this export is 64" in out
