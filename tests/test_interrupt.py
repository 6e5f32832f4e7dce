"""Ctrl-C that a library call swallows still stops generation (nxdc/interrupt.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nxdc import interrupt


@pytest.fixture
def handlers(monkeypatch):
    """Restore this process's SIGINT / SIGTERM handlers and the recorded flag afterwards."""
    monkeypatch.setattr(interrupt, "_seen", False)
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_interrupt_is_still_seen(handlers, sig):
    interrupt.install()
    interrupt.check()  # nothing yet: no raise
    try:
        os.kill(os.getpid(), sig)
        time.sleep(1)  # the handler raises at the next bytecode, well within this
        pytest.fail("the signal raised nothing")
    except KeyboardInterrupt:
        pass  # what the library call that swallows it does
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()


def test_an_ignored_sigint_stays_ignored(handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup / a background job
    interrupt.install()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is interrupt._handler


def test_generation_stops_at_the_next_step(tiny_gqa_export, monkeypatch):
    from transformers import AutoTokenizer

    from nxdc.generation.loop import generate
    from nxdc.runtime.session import Session

    sess = Session(tiny_gqa_export)
    steps = []
    decode = sess.decode

    def decode_then_swallowed_ctrl_c(*a, **k):
        steps.append(1)
        monkeypatch.setattr(interrupt, "_seen", True)  # a signal came and its exception was lost
        return decode(*a, **k)

    monkeypatch.setattr(sess, "decode", decode_then_swallowed_ctrl_c)
    tok = AutoTokenizer.from_pretrained(tiny_gqa_export)
    with pytest.raises(KeyboardInterrupt):
        generate(sess, tok, ["w1 w2 w3"], max_new_tokens=20, eos_ids=set())
    assert len(steps) == 1
