"""Tensor-parallel runtime: one process per rank, all running the same compiled graphs.

``open_runner`` returns a plain ``Runner`` at tp 1. At tp > 1 it starts ranks 1..tp-1 as
worker processes (``python -m nxdc.runtime.workers``), joins them in a ``torch.distributed``
group (gloo on CPU, NCCL on CUDA) as rank 0, and returns rank 0's ``GroupRunner``, which
announces every graph call to the workers (a small broadcast of the graph index and its int64
inputs) before running it; the collectives inside the graphs do the rest. Rank 0 samples and
prints; workers only compute. Under ``torchrun`` (several machines) the launcher starts the
ranks instead and the same protocol runs (``external_rank``).

The announcements travel over their own gloo group (``_control_group``), never over the group
the graphs' collectives use: AOTInductor runs a graph without releasing the GIL, and a gloo
thread finishing one of our Python-owned broadcasts must take the GIL to free its tensors, so
sharing that thread with the graph's collectives deadlocks.

Failure handling: workers die with their parent (``PR_SET_PDEATHSIG``) and ignore Ctrl-C (the
parent stops them); a watcher thread in rank 0 notices a worker that exits and, if the main
thread is stuck in a collective with the dead rank, ends the process with a one-line error.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from nxdc.compile.backends.registry import rules
from nxdc.errors import NxdcError
from nxdc.manifest import load_manifest
from nxdc.runtime.runner import Runner
from nxdc.runtime.session import Session
from nxdc.runtime.threads import default_threads

CALL, STOP = 1, 0
GRACE_S = 5.0  # how long the main thread may stay stuck after a worker died
# collectives; crashes are caught by the watcher long before (NXDC_TP_TIMEOUT_S: tests lower it)
TIMEOUT = timedelta(seconds=float(os.environ.get("NXDC_TP_TIMEOUT_S", 600)))


def external_rank() -> int | None:
    """This process's rank when a launcher (torchrun) started it, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ):
        return int(os.environ["RANK"])
    return None


def _dist_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _control_group():
    """A second group, on its own gloo threads, for rank 0's announcements (see module doc)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _rank_device(device: str, rank: int) -> str | None:
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        return f"cuda:{local}"
    return None


def open_runner(export_dir: str | Path, threads: int | None = None, verify: bool = True) -> Runner:
    manifest = load_manifest(export_dir)
    tp = manifest.plan.tp
    if tp == 1 or rules(manifest.plan.backend).in_process_tp:  # neuron: one process drives every rank
        return Runner(Session(export_dir, threads=threads, verify=verify, manifest=manifest))
    if threads is None:
        threads = max(1, default_threads() // tp)
    if external_rank() is not None:
        return _join_external(export_dir, manifest, tp, threads, verify)
    return TPGroup(export_dir, manifest, tp, threads, verify).runner


def _join_external(export_dir, manifest, tp: int, threads: int, verify: bool) -> GroupRunner:
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise NxdcError(f"{export_dir} was exported for --tp {tp} but the launcher started {world} ranks")
    dist.init_process_group(_dist_backend(manifest.plan.device), timeout=TIMEOUT)
    ctl = _control_group()
    sess = Session(export_dir, threads=threads, verify=verify, rank=0, manifest=manifest)
    return GroupRunner(sess, ctl, on_error=lambda e: NxdcError(f"tensor-parallel collective failed: {e}"))


class GroupRunner(Runner):
    """Rank 0 of a tensor-parallel group: every graph call is announced to the other ranks
    (over ``ctl``, see the module doc) before it runs here; ``group`` (the workers this process
    started, if any) is stopped on close."""

    def __init__(self, session: Session, ctl, on_error, group: TPGroup | None = None):
        super().__init__(session)
        self._names = list(self.manifest.artifacts)
        self._ctl, self._on_error, self._group = ctl, on_error, group
        self.broken = False  # ranks may be out of step: no polite STOP, workers get killed

    def call(self, name: str, *inputs: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        graph = self.session.graphs[name]
        graph.check(inputs)
        try:
            dist.broadcast(
                torch.tensor([CALL, self._names.index(name)], dtype=torch.int64), 0, group=self._ctl
            )
            dist.broadcast(torch.cat([t.reshape(-1).to(torch.int64) for t in inputs]), 0, group=self._ctl)
        except RuntimeError as e:
            self.broken = True
            raise self._on_error(e) from e
        try:
            return graph(*inputs)
        except RuntimeError as e:  # a collective inside the graph failed: a rank is gone
            self.broken = True
            if "KeyboardInterrupt" in str(e):  # Ctrl-C seen inside the graph's custom-op call
                raise KeyboardInterrupt from e
            raise self._on_error(e) from e
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        import torch.distributed as dist

        try:
            if self.broken and self._group is not None:  # out of step: they would never see a STOP
                self._group.kill()
            elif dist.is_initialized() and not self.broken:
                dist.broadcast(torch.tensor([STOP, 0], dtype=torch.int64), 0, group=self._ctl)
        except Exception:
            if self._group is not None:
                self._group.kill()
        finally:
            if self._group is not None:
                self._group.close()


class TPGroup:
    """Ranks 1..tp-1 as child processes of this one (rank 0), and rank 0's ``runner``."""

    def __init__(self, export_dir, manifest: dict, tp: int, threads: int, verify: bool):
        import torch.distributed as dist

        self.tp, self.closing, self.dead = tp, False, None
        port = _free_port()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(tp)}
        env.pop("TORCHELASTIC_RUN_ID", None)
        args = [sys.executable, "-m", "nxdc.runtime.workers", str(export_dir), "--threads", str(threads)]
        args += [] if verify else ["--no-verify"]
        self.procs = [
            subprocess.Popen(
                args, env={**env, "RANK": str(r)}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
            for r in range(1, tp)
        ]
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="nxdc-tp-watch", daemon=True).start()
        try:
            dist.init_process_group(
                _dist_backend(manifest.plan.device),
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=tp,
                timeout=TIMEOUT,
            )
            ctl = _control_group()
            session = Session(export_dir, threads=threads, verify=verify, rank=0, manifest=manifest)
        except BaseException:
            self.close()
            raise
        self.runner = GroupRunner(session, ctl, on_error=self._error, group=self)

    def _error(self, e: Exception) -> Exception:
        deadline = time.monotonic() + 1.0  # a peer's socket closes just before its exit is seen
        while self.dead is None and time.monotonic() < deadline:
            self._check()
            time.sleep(0.05)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return NxdcError(self.dead or f"tensor-parallel collective failed: {first}")

    def _check(self) -> bool:
        """Record the first worker found dead; True if one is."""
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None and not self.closing:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                self.dead = self.dead or f"tensor-parallel worker rank {r} {how}; stopped all ranks"
                return True
        return False

    def _watch(self) -> None:
        while not self.closing:
            if self._check():
                self.kill()
                time.sleep(GRACE_S)  # the main thread normally raises first
                if not self.closing:
                    sys.stderr.write(f"error: {self.dead}\n")
                    sys.stderr.flush()
                    os._exit(1)
                return
            time.sleep(0.1)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def close(self) -> None:
        """Stop every worker (politely first: they were told STOP by the runner's close)."""
        if self.closing:
            return
        self.closing = True
        deadline = time.monotonic() + 3
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follow(export_dir: str | Path, threads: int, verify: bool = True) -> None:
    """A non-zero rank: load this rank's share, then run every graph call rank 0 announces."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    manifest = load_manifest(export_dir)
    device = manifest.plan.device
    if not dist.is_initialized():
        dist.init_process_group(_dist_backend(device), timeout=TIMEOUT)
    ctl = _control_group()
    sess = Session(export_dir, threads=threads, verify=verify, rank=rank, manifest=manifest)
    names = list(manifest.artifacts)
    header = torch.zeros(2, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=ctl)
        op, idx = header.tolist()
        if op == STOP:
            break
        shapes = manifest.artifacts[names[idx]].shapes
        buf = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.int64)
        dist.broadcast(buf, 0, group=ctl)
        inputs, at = [], 0
        for s in shapes:
            n = math.prod(s)
            inputs.append(buf[at : at + n].view(s))
            at += n
        sess.graphs[names[idx]](*inputs)
    dist.destroy_process_group()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    ap = argparse.ArgumentParser(prog="nxdc-tp-worker")
    ap.add_argument("export_dir")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops us
    _die_with_parent()
    parent = os.getppid()
    try:
        if parent == 1:  # parent already gone
            return 1
        follow(a.export_dir, a.threads, not a.no_verify)
    except NxdcError as e:
        sys.stderr.write(f"error: rank {os.environ.get('RANK')}: {e}\n")
        return 1
    except Exception as e:
        sys.stderr.write(f"error: rank {os.environ.get('RANK')}: {type(e).__name__}: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
