"""Progress reporting for long stages: rich on a terminal, nothing with --quiet/--json."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console


class Reporter:
    def stage(self, name: str, total: int | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def update(self, text: str) -> None:
        pass

    def bucket_start(self, name: str) -> None:
        pass

    def bucket_done(self, name: str, hit: bool, reason: str, seconds: float) -> None:
        pass


class NullReporter(Reporter):
    pass


class RichReporter(Reporter):
    """One status line per stage and a line per bucket with its cache hit/miss and reason."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self._status = None

    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None):
        t0 = time.perf_counter()
        with self.console.status(f"[bold]{name}[/]…") as status:
            self._status = status
            yield
        self._status = None
        self.console.print(f"[green]✓[/] {name} [dim]({time.perf_counter() - t0:.1f}s)[/]")

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def bucket_start(self, name: str) -> None:
        if self._status is not None:
            self._status.update(f"[bold]compile[/] {name}: cache lookup / compiling (AOTInductor)…")

    def bucket_done(self, name: str, hit: bool, reason: str, seconds: float) -> None:
        tag = (
            "[green]cache hit[/]"
            if hit
            else f"[yellow]cache miss[/] [dim]({reason.removesuffix(' → built')})[/] → compiled"
        )
        if hit and reason != "hit":  # e.g. "pulled from remote URL"
            tag += f" [dim]({reason})[/]"
        self.console.print(f"  {name:<16} {tag} [dim]{seconds:.1f}s[/]")
