"""``nxdc.export`` (the public Python API) and the flags of ``nxdc export`` / ``nxdc cache pull``
built from one declaration of each export option: the same options, defaults, checks and
one-line errors, and the same export directory."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest
import typer
from tiny import GQA_EXPORT
from typer.testing import CliRunner

import nxdc
from nxdc.cli.main import app
from nxdc.errors import NxdcError, UnsupportedError, UserInputError
from nxdc.plan import ExportOptions

runner = CliRunner()

EXPORT_FLAGS = [
    "--tp",
    "--batch-size",
    "--sequence-length",
    "--max-context-length",
    "--min-context-bucket",
    "--context-buckets",
    "--min-decode-bucket",
    "--decode-buckets",
    "--dtype",
    "--weights",
    "--kv-cache",
    "--speculation-length",
    "--num-layers",
    "--chunk-buckets",
    "--decode-batch-sizes",
    "--backend",
    "--kv-update",
    "--device",
    "--prefill-matmul",
    "--decode-matmul",
]
COMMON = ["--cache-dir", "--json", "--quiet", "--verbose", "--help"]
EXPECTED = {
    "export": [
        "--output",
        "--config",
        *EXPORT_FLAGS,
        "--check-accuracy",
        "--cache-dir",
        "--remote",
        "--require-cache",
        "--dry-run",
        "--config-only",
        *COMMON[1:],
    ],
    "cache pull": ["--key", "--config", *EXPORT_FLAGS, "--remote", *COMMON],
}


def command(path: str):
    cmd = typer.main.get_command(app)
    for name in path.split():
        cmd = cmd.commands[name]
    return cmd


def options(path: str) -> dict[str, str]:
    """Each option's long name -> its help, in the order --help lists them."""
    ctx = typer.Context(command(path))
    return {
        next(o for o in p.opts if o.startswith("--")): p.help
        for p in command(path).get_params(ctx)
        if p.param_type_name == "option"
    }


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_option_set(path):
    """`nxdc export` and `nxdc cache pull` take the expected options, each with help text, the
    export options in ExportOptions' order."""
    opts = options(path)
    assert list(opts) == EXPECTED[path]
    assert all(h and h.strip() for h in opts.values()), [o for o, h in opts.items() if not h]


def test_export_options_declared_once():
    """One flag per ExportOptions field, the same object of help in both commands."""
    fields = [f.name for f in dataclasses.fields(ExportOptions)]
    assert EXPORT_FLAGS == [f"--{n.replace('_', '-')}" for n in fields]
    export, pull = options("export"), options("cache pull")
    assert {f: export[f] for f in EXPORT_FLAGS} == {f: pull[f] for f in EXPORT_FLAGS}
    assert "[default: 1]" in export["--tp"] and "[default: fp32]" in export["--dtype"]
    assert "fp32 | bf16" in export["--dtype"]


def test_common_flags_are_one_declaration():
    """--json / --quiet / --verbose / --cache-dir read the same everywhere they are taken."""
    seen: dict[str, set[str]] = {}
    for path in ["export", "generate", "serve", "doctor", "cache pull", "cache list", "cache push"]:
        for name, text in options(path).items():
            if name in COMMON[:-1]:
                seen.setdefault(name, set()).add(text)
    assert set(seen) == set(COMMON[:-1])
    assert all(len(texts) == 1 for texts in seen.values()), seen


def test_public_names_and_cheap_import():
    code = (
        "import sys, nxdc; assert 'torch' not in sys.modules, 'import nxdc loaded torch'; "
        "from nxdc.pipeline import run_export; import nxdc.api.export as api; "
        "assert nxdc.export is api.export, nxdc.export; print(sorted(nxdc.__all__))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for name in ["export", "ExportResult", "NxdcError", "UserInputError", "UnsupportedError"]:
        assert name in res.stdout
    assert nxdc.ExportResult.__module__ == "nxdc.pipeline"
    assert nxdc.export.__doc__ and nxdc.ExportResult.__doc__


def test_the_attribute_stays_the_function(monkeypatch):
    """Importing the pipeline module (nxdc/pipeline.py) leaves ``nxdc.export`` the function; a
    monkeypatch of it replaces it."""
    import nxdc.api.export as api

    assert nxdc.export is api.export
    monkeypatch.setattr(nxdc, "export", print)
    assert nxdc.export is print
    monkeypatch.undo()
    assert nxdc.export is api.export


def test_signature_lists_every_option_with_its_default():
    params = inspect.signature(nxdc.export).parameters
    assert list(params)[:2] == ["model", "out"]
    for f in dataclasses.fields(ExportOptions):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[f.name].default == f.default


def test_export_matches_the_cli_and_runs(tiny_gqa, tiny_gqa_export, tmp_path):
    """``nxdc.export`` writes what ``nxdc export`` writes for the same options (every graph a
    cache hit of the session's export), and ``nxdc generate`` runs it."""
    lines: list[str] = []
    res = nxdc.export(tiny_gqa, tmp_path / "api", progress=lines.append, **GQA_EXPORT)
    assert isinstance(res, nxdc.ExportResult)
    assert res.out == (tmp_path / "api").resolve()
    assert (res.cache_hits, res.compiled) == (len(res.plan.buckets), 0)
    assert "compile…" in lines and any(ln.endswith("s)") and "cache hit" in ln for ln in lines), lines

    flags = ["--batch-size", "2", "--sequence-length", "64", "--context-buckets", "16,32"]
    cli = runner.invoke(
        app,
        ["export", str(tiny_gqa), "-o", str(tmp_path / "cli"), *flags, "--decode-buckets", "32,64", "--json"],
    )
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["plan"] == as_json(res.plan.to_dict())
    api_m, cli_m = (json.loads((tmp_path / d / "nxdc.json").read_text()) for d in ("api", "cli"))
    assert api_m["plan"] == cli_m["plan"]
    assert {k: a["key"] for k, a in api_m["artifacts"].items()} == {
        k: a["key"] for k, a in cli_m["artifacts"].items()
    }
    gen = runner.invoke(app, ["generate", str(tmp_path / "api"), "-p", "w1 w2 w3", "-n", "4", "--json"])
    assert gen.exit_code == 0, gen.output
    assert json.loads(gen.stdout)["stats"]["new_tokens"] == 4


def as_json(obj):
    return json.loads(json.dumps(obj))


def cli_error(args) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    return res.stderr


@pytest.mark.parametrize(
    "kwargs, flags, error",
    [
        (dict(tp=8), ["--tp", "8"], UnsupportedError),
        (dict(dtype="fp8"), ["--dtype", "fp8"], UserInputError),
        (dict(batch_size=0), ["--batch-size", "0"], UserInputError),
        (dict(context_buckets="16,x"), ["--context-buckets", "16,x"], UserInputError),
    ],
)
def test_bad_options_raise_the_cli_messages(tiny_gqa, tmp_path, kwargs, flags, error):
    with pytest.raises(error) as e:
        nxdc.export(tiny_gqa, tmp_path / "o", **kwargs)
    assert str(e.value) in cli_error(["export", tiny_gqa, "-o", tmp_path / "o", *flags])
    assert not (tmp_path / "o").exists()


def test_missing_model_and_output(tmp_path):
    with pytest.raises(UserInputError) as e:
        nxdc.export(tmp_path / "nope", tmp_path / "o")
    assert "does not exist" in str(e.value)
    assert str(e.value) in cli_error(["export", tmp_path / "nope", "-o", tmp_path / "o"])
    with pytest.raises(UserInputError, match="missing MODEL"):
        nxdc.export(None, tmp_path / "o")
    with pytest.raises(UserInputError, match="missing -o/--output"):
        nxdc.export("smollm2-135m")


def test_unknown_option_is_named(tmp_path):
    with pytest.raises(UserInputError, match="unknown export options batchsize, tpp") as e:
        nxdc.export("smollm2-135m", tmp_path / "o", tpp=2, batchsize=4)
    assert isinstance(e.value, NxdcError) and "(known: tp, batch_size," in str(e.value)
    assert not (tmp_path / "o").exists()


def test_preset_and_keywords(tmp_path):
    """A TOML preset, overridden by the keywords given, as `--config` with flags."""
    from nxdc.api.export import plan_export

    summary = plan_export(config="configs/smollm2-135m-cpu.toml", batch_size=4)
    assert summary["model"] == "smollm2-135m"
    assert summary["plan"]["batch_size"] == 4 and summary["plan"]["sequence_length"] == 1024
    res = runner.invoke(
        app,
        ["export", "--config", "configs/smollm2-135m-cpu.toml", "--dry-run", "--json", "--batch-size", "4"],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == as_json(summary)
