"""The one text layer (nxdc.generation.text.TextStream) that nxdc generate / bench and nxdc serve
share: what each token sends, and when and why a sequence ends (EOS, a stop string, the token
budget, the cache), with stop strings and multi-byte characters split across tokens."""

from __future__ import annotations

import pytest

from nxdc.generation.loop import Outputs
from nxdc.generation.text import TextStream

EOS = 0


class ByteTok:
    """A tokenizer over byte strings (a character may span tokens), decoding like transformers'."""

    def __init__(self, *pieces: str | bytes):
        self.vocab = [b"</s>"] + [p.encode() if isinstance(p, str) else p for p in pieces]

    def ids(self, *pieces) -> list[int]:
        return [self.vocab.index(p.encode() if isinstance(p, str) else p) for p in pieces]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == EOS)).decode(
            "utf-8", errors="replace"
        )


SMILE = "🙂".encode()
TOK = ByteTok("Hel", "lo", " wor", "ld", "!", "x<", "/s", ">", "tail", SMILE[:1], SMILE[1:3], SMILE[3:])


def run(tokens, **kw):
    """Push tokens until the stream finishes: (pieces sent, the rest, the stream)."""
    kw.setdefault("max_new_tokens", 100)
    s = TextStream(TOK, **kw)
    sent, rest = [], ""
    for t in tokens:
        piece = s.push(t)
        sent.append(piece.text)
        rest = piece.rest
        if s.finished:
            break
    return sent, rest, s


def test_eos_ends_with_stop_and_sends_no_text():
    sent, rest, s = run(TOK.ids("Hel", "lo") + [EOS, *TOK.ids("tail")], eos={EOS})
    assert sent == ["Hel", "lo", None] and rest == ""
    assert (s.finish_reason, s.cause, s.tokens) == ("stop", "eos", 3)


def test_eos_releases_a_held_back_partial_stop_string():
    sent, rest, s = run(TOK.ids("Hel", "lo", " wor") + [EOS], eos={EOS}, stops=["world"])
    assert sent == ["Hel", "lo", " ", None] and rest == "wor"
    assert s.cause == "eos"


def test_ignored_eos_is_a_token_like_another():
    sent, rest, s = run([EOS, *TOK.ids("Hel")], max_new_tokens=2)
    assert sent == ["", "Hel"] and s.cause == "max_new_tokens"


def test_stop_string_across_tokens_is_never_sent():
    sent, rest, s = run(TOK.ids("Hel", "lo", " wor", "ld", "!"), stops=["o world", "never"])
    assert sent == ["Hel", "l", "", ""] and rest == ""  # "o" held back: it may start "o world"
    assert (s.finish_reason, s.cause) == ("stop", "stop_string")


def test_stop_string_at_the_very_start():
    sent, rest, s = run(TOK.ids("x<", "/s", ">", "tail"), stops=["x</s>"])
    assert sent == ["", "", ""] and rest == "" and s.cause == "stop_string"


def test_text_after_a_stop_string_is_dropped():
    sent, rest, s = run(TOK.ids("Hel", "lo", "tail"), stops=["lot"])
    assert "".join(sent) + rest == "Hel" and s.cause == "stop_string"


@pytest.mark.parametrize("room, cause", [(None, "max_new_tokens"), (3, "max_new_tokens"), (2, "max_seq")])
def test_length_and_cache_limits(room, cause):
    sent, rest, s = run(TOK.ids("Hel", "lo", " wor", "ld"), max_new_tokens=3, room=room, stops=["worx"])
    assert s.tokens == (2 if cause == "max_seq" else 3)
    assert (s.finish_reason, s.cause) == ("length", cause)
    assert "".join(sent) + rest == (
        "Hello" if cause == "max_seq" else "Hello wor"
    )  # "wor" held back, then released


def test_a_character_split_over_tokens_is_sent_once_whole():
    sent, rest, s = run(TOK.ids("Hel", SMILE[:1], SMILE[1:3], SMILE[3:], "lo"), max_new_tokens=5)
    assert sent == ["Hel", "", "", "🙂", "lo"] and rest == ""
    sent, rest, s = run(TOK.ids("Hel", SMILE[:1], SMILE[1:3]), max_new_tokens=3)
    assert sent == ["Hel", "", ""] and rest == "\ufffd"  # cut mid-character at the end


def test_not_live_decodes_once_at_the_end():
    ids = TOK.ids("Hel", SMILE[:1], SMILE[1:3], SMILE[3:], "lo")
    sent, rest, s = run(ids, max_new_tokens=5, live=False)
    assert sent == [""] * 5 and rest == TOK.decode(ids)
    sent, rest, s = run(ids, max_new_tokens=5, live=False, stops=["🙂"])  # stop strings need text
    assert sent == ["Hel", "", "", ""] and s.cause == "stop_string"


def test_no_token_after_the_end():
    _, _, s = run([EOS], eos={EOS})
    with pytest.raises(RuntimeError, match="finished"):
        s.push(EOS)


def test_generation_outputs_keep_stop_reason_and_add_finish_reason():
    ids = TOK.ids
    streamed = []
    outs = Outputs(TOK, [[1, 2], [1, 2, 3], [1], [1]], 3, 5, {EOS}, ["wor"], streamed.append)
    feeds = {
        0: ids("Hel", "lo", " wor"),  # stop string
        1: ids("Hel", "lo", "tail"),  # cache full (3 + 2 = 5)
        2: ids("Hel") + [EOS],
        3: ids("Hel", "lo", "!"),  # -n
    }
    for i, toks in feeds.items():
        for t in toks:
            outs.push(i, t)
            outs.flush()
    assert outs.done and not outs.push(0, EOS)
    got = [(r.text, r.token_ids, r.stop_reason, r.finish_reason) for r in outs.results(["p"] * 4)]
    assert got == [
        ("Hello ", ids("Hel", "lo", " wor"), "stop", "stop"),
        ("Hello", ids("Hel", "lo"), "max_seq", "length"),
        ("Hel", ids("Hel"), "eos", "stop"),  # EOS neither printed nor in token_ids
        ("Hello!", ids("Hel", "lo", "!"), "length", "length"),
    ]
    assert "".join(streamed) == "Hello " and all("w" not in t for t in streamed)


def test_transformers_and_serve_tokenizers_stream_the_same_text(tmp_path):
    from tiny import WORDS, tiny_tokenizer

    from nxdc.serve.text import TextTokenizer

    hf = tiny_tokenizer()
    hf.save_pretrained(tmp_path)
    ids = hf(" ".join(WORDS[:8]), add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    texts = []
    for tok in (hf, TextTokenizer(tmp_path)):
        s = TextStream(tok, max_new_tokens=100, eos={hf.eos_token_id}, stops=[WORDS[5]])
        pieces = [s.push(t) for t in ids[:6]]
        texts.append("".join(p.text + p.rest for p in pieces))
        assert s.cause == "stop_string"
    assert texts[0] == texts[1] == hf.decode(ids[:5]) + " "


def test_eos_ids_are_the_models_and_the_tokenizers():
    from types import SimpleNamespace

    from nxdc.generation.text import eos_ids

    assert eos_ids([2, 7], SimpleNamespace(eos_token_id=9)) == {2, 7, 9}
    assert eos_ids((), SimpleNamespace(eos_token_id=None)) == set()
