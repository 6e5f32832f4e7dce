"""nxdc command line: thin wrappers that parse options, call the pipeline, render results."""

from __future__ import annotations

import os

# Transparent huge pages for the CPU allocator (fewer TLB misses on the weight stream);
# must be set before torch allocates.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings  # noqa: E402

# torch/transformers deprecation chatter is for their developers, not our users
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

import typer  # noqa: E402

from nxdc.cli.bench import bench  # noqa: E402
from nxdc.cli.cache import app as cache_app  # noqa: E402
from nxdc.cli.doctor import doctor  # noqa: E402
from nxdc.cli.export import export  # noqa: E402
from nxdc.cli.generate import generate  # noqa: E402
from nxdc.cli.serve import serve  # noqa: E402

app = typer.Typer(
    name="nxdc",
    help="Compile decoder LLMs into fixed-shape buckets through a content-addressed cache, then generate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _name, _fn in (
    ("export", export),
    ("generate", generate),
    ("serve", serve),
    ("bench", bench),
    ("doctor", doctor),
):
    # the command list shows the docstring's first paragraph as written: one line per sentence
    app.command(_name, short_help=" ".join(_fn.__doc__.split("\n\n")[0].split()))(_fn)
app.add_typer(cache_app, name="cache")


def _print_version() -> None:
    import torch

    import nxdc

    typer.echo(f"nxdc {nxdc.__version__} (torch {torch.__version__})")


def _version_option(value: bool) -> None:
    if value:
        _print_version()
        raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_version_option,
        help="Print nxdc and torch versions and exit.",
    ),
) -> None:
    pass


@app.command("version")
def version() -> None:
    """Print nxdc and torch versions."""
    _print_version()


def _terminate(signum, frame):
    # `kill` (SIGTERM) unwinds like Ctrl-C, so temp dirs are removed and nothing half-written stays
    raise KeyboardInterrupt


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    app()


if __name__ == "__main__":
    main()
