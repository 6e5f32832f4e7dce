"""Every bad input gets one clear line and a non-zero exit, never a traceback; the happy
paths print what scripts need (--json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nxdc.cli.main import app

runner = CliRunner()


def run(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


def assert_error(args, code, *needles):
    exit_code, out, err = run(*args)
    assert exit_code == code, (exit_code, out, err)
    assert "Traceback" not in out + err
    assert err.strip().startswith("error:"), err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize(
    "command, shown",
    [
        (
            ["export"],
            [
                "[default: 1]",
                "[default: fp32]",
                "[default: auto for GGUF at --dtype fp32 on CPU, else --dtype]",
            ],
        ),
        (["generate"], ["[default: cores available]"]),
        (["cache", "list"], ["[default: local, plus the remote"]),
    ],
)
def test_help_shows_defaults(command, shown):
    """The "[default: ...]" of a help text is printed, not taken for rich markup and dropped."""
    res = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    for s in shown:
        assert s in res.output, s


def test_version_and_command_list():
    """`nxdc --version` prints what `nxdc version` does; the command list shows each command's
    summary as one paragraph (not broken where the docstring's source line ends)."""
    code, out, _ = run("--version")
    assert code == 0 and out.startswith("nxdc ") and "torch" in out, out
    assert run("version")[1] == out
    res = runner.invoke(app, ["--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0 and "Exports made with --tp N run N processes" in res.output, res.output


def test_missing_model(tmp_path):
    assert_error(["export", tmp_path / "nope", "-o", tmp_path / "o"], 2, "does not exist")


def test_unknown_model_name(tmp_path):
    assert_error(["export", "not-a-model", "-o", tmp_path / "o"], 2, "not found", "smollm2-135m")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_error(
        ["export", tmp_path / "m", "-o", tmp_path / "o"], 2, "unsupported architecture 'gpt2'", "llama"
    )


def test_hub_id_offline_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert_error(
        ["export", "nobody/no-such-model", "-o", tmp_path / "o"], 2, "not in the local Hugging Face cache"
    )


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--dtype", "fp8"], "--dtype must be one of"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--sequence-length", "100000"], "exceeds the model's max_position_embeddings"),
        (["--sequence-length", "128", "--max-context-length", "256"], "exceeds --sequence-length"),
        (["--context-buckets", "16,x"], "comma-separated integers"),
        (["--tp", "8"], "exceeds the model's 4 attention heads"),
        (["--backend", "neuron"], "torch-neuronx==2.9.0.2.15.32035"),
        (["--backend", "tpu"], "--backend must be one of"),
        (["--device", "cuda"], "no CUDA device"),
    ],
)
def test_bad_export_options(tiny_gqa, tmp_path, flags, needle):
    assert_error(["export", tiny_gqa, "-o", tmp_path / "o", *flags], 2, needle)
    assert not (tmp_path / "o").exists()


def test_refuses_to_overwrite_foreign_directory(tiny_gqa, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "precious.txt").write_text("keep me")
    assert_error(["export", tiny_gqa, "-o", tmp_path / "o"], 2, "not an nxdc export")
    assert (tmp_path / "o" / "precious.txt").read_text() == "keep me"


def test_bad_config_file(tiny_gqa, tmp_path):
    cfg = tmp_path / "x.toml"
    cfg.write_text("[export]\nbatchsize = 2\n")
    assert_error(["export", tiny_gqa, "-o", tmp_path / "o", "--config", cfg], 2, "unknown keys batchsize")


def test_dry_run_reads_no_weights(tmp_path):
    code, out, err = run("export", "smollm2-135m", "-o", tmp_path / "o", "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["arch"] == "llama"
    assert [b["length"] for b in plan["plan"]["buckets"]] == [128, 256, 512, 1024, 256, 512, 1024]
    from nxdc.kernels import cpu_supported, disabled

    if cpu_supported() and not disabled():  # the GGUF's Q4_1 / Q8_0 tensors kept (the default)
        assert plan["plan"]["weights"] == "gguf" and plan["weight_bytes"] < plan["params"]
    else:  # dequantized to fp32
        assert plan["weight_bytes"] == plan["params"] * 4
    assert not (tmp_path / "o").exists()


PRESET = ["export", "--config", "configs/smollm2-135m-cpu.toml", "--dry-run"]


def test_config_preset_values_and_flag_override(tmp_path):
    code, out, err = run(*PRESET, "-o", tmp_path / "o", "--json", "--batch-size", "4")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["batch_size"] == 4 and plan["sequence_length"] == 1024
    names = [f"{b['kind']}-{b['length']}" for b in plan["buckets"]]
    assert names == [
        "context-128",
        "context-256",
        "context-512",
        "context-1024",
        "decode-256",
        "decode-512",
        "decode-1024",
    ]
    # a flag that conflicts with the preset's explicit buckets is refused, not silently adjusted
    assert_error(
        [*PRESET, "-o", tmp_path / "o", "--sequence-length", "512"],
        2,
        "context bucket 1024 exceeds the max context length 512",
    )


@pytest.mark.slow
class TestGenerate:
    def test_not_an_export(self, tmp_path):
        assert_error(["generate", tmp_path, "-p", "hi"], 2, "is not an nxdc export")

    def test_prompt_too_long(self, tiny_gqa_export):
        prompt = " ".join(f"w{i}" for i in range(40))
        assert_error(
            ["generate", tiny_gqa_export, "-p", prompt],
            2,
            "40 tokens",
            "largest context bucket",
            "32",
            "--max-context-length",
        )

    def test_too_many_prompts(self, tiny_gqa_export):
        assert_error(["generate", tiny_gqa_export, "-p", "w1", "-p", "w2", "-p", "w3"], 2, "batch size is 2")

    @pytest.fixture
    def copied(self, tiny_gqa_export, tmp_path):
        d = tmp_path / "e"
        shutil.copytree(tiny_gqa_export, d)
        return d

    def test_other_torch_version(self, copied):
        d = copied
        m = json.loads((d / "nxdc.json").read_text())
        m["torch_version"] = "1.0.0"
        (d / "nxdc.json").write_text(json.dumps(m))
        assert_error(["generate", d, "-p", "w1"], 2, "compiled with torch 1.0.0", "re-run nxdc export")

    def test_missing_artifact(self, copied):
        d = copied
        (d / "artifacts" / "decode-64.pt2").unlink()
        assert_error(["generate", d, "-p", "w1"], 2, "decode-64.pt2 is missing")

    def test_corrupt_artifact(self, copied):
        d = copied
        with open(d / "artifacts" / "context-16.pt2", "r+b") as f:
            f.write(b"junk")
        assert_error(["generate", d, "-p", "w1"], 2, "corrupt")

    @pytest.fixture
    def with_kernels(self, copied):
        m = json.loads((copied / "nxdc.json").read_text())
        if not m["kernels"]:  # exported without nxdc's kernels: no AVX2/FMA or no compiler here
            pytest.skip("the tiny export does not use nxdc's CPU kernels on this machine")
        return copied, m

    def test_export_runs_its_own_kernel_library(self, with_kernels, tmp_path):
        d, m = with_kernels
        lib = m["kernel_library"]
        assert lib["path"] == "kernels/nxdc_kernels.so" and (d / lib["path"]).stat().st_size == lib["bytes"]
        # Pretend the export came from another nxdc (other kernels) and run it in a fresh process
        # with an empty cache: it loads its own copy, builds nothing, and generates.
        m["kernels"] = "0" * 16
        (d / "nxdc.json").write_text(json.dumps(m))
        cache = tmp_path / "empty-cache"
        env = {**os.environ, "NXDC_CACHE_DIR": str(cache)}
        cmd = [sys.executable, "-c", "from nxdc.cli.main import main; main()", "generate", str(d)]
        res = subprocess.run(
            [*cmd, "-p", "w1 w2", "-n", "4", "--json"], env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr
        assert len(json.loads(res.stdout)["results"][0]["token_ids"]) == 4
        assert not (cache / "kernels").exists()
        # this process already runs this nxdc's kernels: another build cannot join them
        assert_error(
            ["generate", d, "-p", "w1"], 2, f"compiled against nxdc kernels {'0' * 16}", "already runs"
        )

    def test_corrupt_or_missing_kernel_library(self, with_kernels):
        d, m = with_kernels
        with open(d / "kernels" / "nxdc_kernels.so", "r+b") as f:
            f.write(b"junk")
        assert_error(["generate", d, "-p", "w1"], 2, "kernel library kernels/nxdc_kernels.so is corrupt")
        (d / "kernels" / "nxdc_kernels.so").unlink()
        assert_error(["generate", d, "-p", "w1"], 2, "kernels/nxdc_kernels.so is missing")
        # an export from before exports carried their kernels, made with other kernels
        del m["kernel_library"]
        m["kernels"] = "0" * 16
        (d / "nxdc.json").write_text(json.dumps(m))
        assert_error(["generate", d, "-p", "w1"], 2, "carries no copy of them", "re-run nxdc export")

    @pytest.mark.parametrize(
        "flags, needle",
        [
            (["--threads", "0"], "--threads must be a positive integer"),
            (["--do-sample", "--temperature", "0"], "--temperature must be > 0"),
            (["--top-p", "1.5"], "--top-p must be in"),
            (["-n", "0"], "--max-new-tokens must be >= 1"),
            (["--chat"], "no chat template"),
        ],
    )
    def test_bad_generate_options(self, tiny_gqa_export, flags, needle):
        assert_error(["generate", tiny_gqa_export, "-p", "w1 w2", *flags], 2, needle)

    def test_json_output(self, tiny_gqa_export):
        code, out, err = run("generate", tiny_gqa_export, "-p", "w1 w2 w3", "-p", "w4", "-n", "5", "--json")
        assert code == 0, err
        res = json.loads(out)
        assert [r["prompt_tokens"] for r in res["results"]] == [3, 1]
        assert all(len(r["token_ids"]) <= 5 for r in res["results"])
        assert res["stats"]["new_tokens"] == sum(len(r["token_ids"]) for r in res["results"])
        assert res["stats"]["decode_tokens_per_s"] > 0

    def test_stopping_at_the_sequence_length_is_reported(self, tiny_gqa_export):
        code, out, err = run("generate", tiny_gqa_export, "-p", "w1 w2", "-n", "500", "--json")
        assert code == 0, err
        res = json.loads(out)["results"][0]
        assert res["stop_reason"] == "max_seq"
        assert res["prompt_tokens"] + len(res["token_ids"]) == 64  # GQA_EXPORT's sequence length
        code, out, err = run("generate", tiny_gqa_export, "-p", "w1 w2", "-n", "500")
        assert code == 0, err
        assert "stopped at the export's sequence length, 64 tokens" in err
        code, out, err = run("generate", tiny_gqa_export, "-p", "w1 w2", "-n", "5")
        assert code == 0 and "sequence length" not in err, err

    def test_sampling_is_reproducible_with_seed(self, tiny_gqa_export):
        args = [
            "generate",
            tiny_gqa_export,
            "-p",
            "w1 w2",
            "-n",
            "12",
            "--do-sample",
            "--temperature",
            "1.5",
            "--top-k",
            "50",
            "--top-p",
            "0.95",
            "--json",
        ]
        runs = [json.loads(run(*args, "--seed", s)[1])["results"][0]["token_ids"] for s in ("7", "7", "8")]
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]

    def test_stop_string_and_stream(self, tiny_gqa_export):
        code, out, _ = run("generate", tiny_gqa_export, "-p", "w1 w2", "-n", "12", "--json")
        full = json.loads(out)["results"][0]["text"]
        stop = full.split()[3]
        code, out, err = run(
            "generate", tiny_gqa_export, "-p", "w1 w2", "-n", "12", "--stop", stop, "--stream"
        )
        assert code == 0, err
        assert out.strip() == full[: full.index(stop)].strip()


@pytest.mark.parametrize(
    "option, value, needle",
    [
        ("--step-budget", "0.5", "--step-budget must be 0 (off) or at least 1"),
        ("--step-budget", "nan", "--step-budget must be 0 (off) or at least 1"),
        ("--max-body-bytes", "0", "--max-body-bytes must be a positive integer"),
        ("--prefill-chunk", "-4", "--prefill-chunk must be a positive integer"),
    ],
)
def test_serve_refuses_bad_options_in_one_line(tmp_path, option, value, needle):
    assert_error(["serve", tmp_path, option, value, "--port", "0"], 2, needle)
