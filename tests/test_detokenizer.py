"""IncrementalDetokenizer: matches a full decode, stop strings, streaming hold-back, special tokens."""

from __future__ import annotations

import random

import pytest
from tokenizer_factory import make_test_tokenizer
from transformers import AutoTokenizer

from kiln.runtime.engine.detokenizer import IncrementalDetokenizer

UNICODE_TEXT = "héllo wörld 日本語 🎉 the café sees die Straße, Мария любит 東京!"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(detok: IncrementalDetokenizer, ids) -> tuple[str | None, list[str]]:
    """Feed ids until a stop matches; return the matched stop and readable_text after each token."""
    shown = []
    for token_id in ids:
        matched = detok.add_token(token_id)
        shown.append(detok.readable_text(finished=False))
        if matched is not None:
            return matched, shown
    return None, shown


def test_factory_tokenizer(tokenizer, tmp_path):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    ids = tokenizer(UNICODE_TEXT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert full_decode(tokenizer, ids) == UNICODE_TEXT
    assert len(tokenizer) == 400
    make_test_tokenizer(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(UNICODE_TEXT)["input_ids"] == ids
    assert reloaded.eos_token_id == tokenizer.eos_token_id


def test_random_token_sequences_match_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        _, shown = stream(detok, output)
        expected = full_decode(tokenizer, output)
        assert detok.text == expected
        assert detok.readable_text(finished=True) == expected
        assert all(expected.startswith(s) for s in shown)  # streamed text only grows, never changes


def test_unicode_text_matches_and_never_streams_half_characters(tokenizer):
    prompt = tokenizer("Say it: ")["input_ids"]
    output = encode(tokenizer, UNICODE_TEXT)
    # The test only means something if some characters really are split across tokens.
    assert any("\ufffd" in full_decode(tokenizer, [t]) for t in output)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    _, shown = stream(detok, output)
    assert detok.text == UNICODE_TEXT
    assert all("\ufffd" not in s and UNICODE_TEXT.startswith(s) for s in shown)
    assert shown[-1] == UNICODE_TEXT


def test_text_stops_right_before_stop_string(tokenizer):
    output = encode(tokenizer, "the cat eats an apple. the dog")
    detok = IncrementalDetokenizer(tokenizer, [0], stop=["apple", "dog"])
    matched, _ = stream(detok, output)
    assert matched == "apple"
    assert detok.text == "the cat eats an "
    assert detok.readable_text(finished=True) == "the cat eats an "
    with pytest.raises(RuntimeError, match="after stop string"):
        detok.add_token(output[-1])


def test_stop_string_spanning_several_tokens(tokenizer):
    stop = "wörld 日本"
    output = encode(tokenizer, UNICODE_TEXT)
    assert not any(stop in full_decode(tokenizer, [t]) for t in output)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    matched, _ = stream(detok, output)
    assert matched == stop
    assert detok.text == "héllo "


def test_earliest_stop_string_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["blue", "the"])
    matched, _ = stream(detok, encode(tokenizer, "a red ball and the blue sky"))
    assert matched == "the"
    assert detok.text == "a red ball and "


def test_stop_string_at_the_start(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [0], stop=["the"])
    matched, shown = stream(detok, encode(tokenizer, "the cat"))
    assert matched == "the"
    assert detok.text == ""
    assert all(s == "" for s in shown)


def test_readable_text_never_shows_text_that_is_cut(tokenizer):
    rng = random.Random(1)
    words = ["the", "cat", "café", "日本語", "🎉", "Straße", "sees", "apple."]
    stops = ["café 日", "🎉 S", "apple.", "xyz"]
    for _ in range(60):
        text = " ".join(rng.choice(words) for _ in range(12))
        detok = IncrementalDetokenizer(tokenizer, [0], stop=stops)
        matched, shown = stream(detok, encode(tokenizer, text))
        final = detok.text
        assert all(final.startswith(s) for s in shown)
        if matched is None:
            assert final == text
        else:
            assert text.startswith(final + matched)
            assert not any(s in final for s in stops)


def test_special_tokens(tokenizer):
    output = [*encode(tokenizer, "the cat"), tokenizer.eos_token_id]
    skipped = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    stream(skipped, output)
    assert skipped.text == "the cat"
    kept = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], skip_special_tokens=False)
    stream(kept, output)
    assert kept.text == "the cat</s>"


def test_no_tokenizer():
    detok = IncrementalDetokenizer(None, [1, 2, 3], stop=["a"])
    assert [detok.add_token(t) for t in (5, 6)] == [None, None]
    assert detok.text == ""
    assert detok.readable_text(finished=False) == detok.readable_text(finished=True) == ""


def test_deferred_tokens_decode_together_to_the_same_text(tokenizer):
    """defer (the engine's final-only steps) decodes the tokens it held all at once when the text is read or a
    token is added: the same text as adding them one by one, half characters included."""
    rng = random.Random(1)
    vocab = len(tokenizer)
    unicode_ids = encode(tokenizer, UNICODE_TEXT)
    for trial in range(100):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = unicode_ids if trial == 0 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        one_by_one, deferred = IncrementalDetokenizer(tokenizer, prompt), IncrementalDetokenizer(tokenizer, prompt)
        stream(one_by_one, output)
        cut = rng.randrange(len(output) + 1)
        for token_id in output[:cut]:
            deferred.defer(token_id)
        if cut < len(output):  # a token added normally after deferred ones: they are decoded first, in order
            deferred.add_token(output[cut])
            for token_id in output[cut + 1:]:
                deferred.defer(token_id)
        assert deferred.text == one_by_one.text == full_decode(tokenizer, output)
        assert deferred.readable_text(finished=True) == one_by_one.text


def test_defer_refuses_a_request_with_stop_strings(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [0], stop=["x"])
    with pytest.raises(RuntimeError, match="without stop strings"):
        detok.defer(5)


def _metaspace_tokenizer(tmp_path):
    """A SentencePiece-style tokenizer (Metaspace: the first token of a decode loses its leading space), the
    case the prompt context exists for."""
    from tokenizer_factory import training_sentences
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(training_sentences(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_the_rust_stream_emits_what_the_python_steps_emit(tokenizer, tmp_path, kind):
    """tokenizers' DecodeStream (the fast path) and the Python prefix-offset steps give the same text token by
    token, with a prompt context, special tokens kept or skipped, and stop strings."""
    tok = tokenizer if kind == "byte-level" else _metaspace_tokenizer(tmp_path)
    rng = random.Random(3)
    vocab = len(tok)
    for trial in range(120):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        stop = [full_decode(tok, output)[3:5]] if trial % 3 == 0 and len(full_decode(tok, output)) > 5 else []
        skip = trial % 2 == 0
        fast = IncrementalDetokenizer(tok, prompt, stop, skip_special_tokens=skip)
        slow = IncrementalDetokenizer(tok, prompt, stop, skip_special_tokens=skip)
        assert fast._stream is not None
        slow._stream = None
        for token_id in output:
            matched = fast.add_token(token_id)
            assert matched == slow.add_token(token_id)
            assert fast.readable_text(finished=False) == slow.readable_text(finished=False)
            if matched is not None:
                break
        assert fast.text == slow.text
        if not stop and kind == "byte-level":  # random byte-fallback garbage need not decode alike in pieces
            assert fast.text == full_decode(tok, output, skip_special_tokens=skip)


def test_a_stream_that_refuses_a_token_hands_over_to_the_python_steps(tokenizer):
    class Refusing:
        def step(self, backend, ids):
            raise Exception("DecodeStream: invalid prefix")

    output = encode(tokenizer, UNICODE_TEXT)
    detok = IncrementalDetokenizer(tokenizer, [0])
    for token_id in output[:5]:
        detok.add_token(token_id)
    detok._stream = Refusing()
    for token_id in output[5:]:
        detok.add_token(token_id)
    assert detok._stream is None and detok.text == UNICODE_TEXT
