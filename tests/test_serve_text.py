"""nxdc serve's torch-free text handling: prompts and chat templates encode to exactly the ids
``nxdc generate`` (transformers) gives, incremental detokenization adds up to the whole text
(multi-byte characters included), and stop strings never leak, whatever the token split."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny import tiny_tokenizer

from nxdc.generation.loop import encode_prompts
from nxdc.generation.text import Detokenizer, StopStrings
from nxdc.serve.text import TextTokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another, with an emoji: 🙂 and ünïcödé?"},
]


@pytest.fixture(scope="module")
def smollm2_tok_dir(tmp_path_factory):
    from nxdc.weights.sources import resolve

    d = tmp_path_factory.mktemp("smollm2-tok")
    resolve("smollm2-135m").save_tokenizer(d)
    return d


def test_prompts_and_chat_encode_like_transformers(smollm2_tok_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2_tok_dir)
    ours = TextTokenizer(smollm2_tok_dir)
    for text in ("Once upon a time", "  leading spaces, tabs\tand\nnewlines", "日本語 🙂"):
        assert ours.encode(text) == encode_prompts(ref, [text], chat=False)[0]
        assert (
            ours.encode_chat([{"role": "user", "content": text}]) == encode_prompts(ref, [text], chat=True)[0]
        )
    want = ref.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.encode_chat(CONVERSATION) == list(want)
    assert ours.eos_token_id == ref.eos_token_id
    ids = ref("A café, naïve 🙂 résumé.\n<|im_end|>")["input_ids"]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_tokenizer_needs_no_torch(smollm2_tok_dir):
    code = (
        "import sys; from nxdc.serve.text import TextTokenizer; "
        f"t = TextTokenizer({str(smollm2_tok_dir)!r}); t.encode_chat([{{'role': 'user', 'content': 'hi'}}]); "
        "t.decode([1, 2, 3]); import nxdc.serve.app; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_detokenizer_pieces_add_up_to_the_whole_text(smollm2_tok_dir):
    tok = TextTokenizer(smollm2_tok_dir)
    text = "Emoji 🙂🎉 split over byte tokens, ünïcödé, 日本語テキスト, and plain words.\nDone."
    ids = tok.encode(text)
    d = Detokenizer(tok)
    pieces = [d.add(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a character is sent only once it is whole


def test_chat_template_errors_and_absence(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    tok = TextTokenizer(tmp_path)
    with pytest.raises(Exception, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "w1"}])
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('only users may speak') }}")
    with pytest.raises(Exception, match="only users may speak"):
        TextTokenizer(tmp_path).encode_chat([{"role": "user", "content": "w1"}])


@pytest.mark.parametrize(
    "pieces, stops, sent, stopped",
    [
        (["Hello", " wor", "ld", "!"], ["world"], "Hello ", True),
        (["ab", "c", "d"], ["cde"], "abcd", False),  # held back while it might match, then released
        (["x<", "/s", ">", "tail"], ["</s>"], "x", True),
        (["no", " stop", " here"], [], "no stop here", False),
        (["aXb", "Y"], ["XbY", "bY"], "a", True),  # the earliest match wins
        (["one\n\n", "two"], ["\n\n"], "one", True),
    ],
)
def test_stop_strings(pieces, stops, sent, stopped):
    s = StopStrings(stops)
    out, hit = "", False
    for p in pieces:
        text, hit = s.feed(p)
        out += text
        assert not any(stop[:2] in text for stop in stops if len(stop) > 1 and stop[:2] not in sent)
        if hit:
            break
    if not hit:
        out += s.flush()
    assert (out, hit) == (sent, stopped)
