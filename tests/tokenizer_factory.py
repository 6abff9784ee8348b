"""A tiny byte-level BPE tokenizer, trained in-process, for tests and tiny models.

`make_test_tokenizer(tmp_dir)` trains it on ~1,400 short English/unicode sentences (every combination
of a few word lists), saves it with `save_pretrained(tmp_dir)` and returns it. bos=`<s>` (id 0), eos=`</s>` (id 1); `tokenizer(text)`
prepends the BOS id. Byte-level, so every string round-trips and multi-byte characters split across
tokens, which is what detokenizer tests need.
"""

from __future__ import annotations

import itertools
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 400

_SUBJECTS = ["the cat", "a small dog", "my friend", "the old man", "she", "we", "Der Bär", "le garçon",
             "el niño", "Мария", "東京の人", "the robot 🤖"]
_VERBS = ["eats", "sees", "likes", "paints", "finds", "sieht", "mange", "quiere", "любит", "見る"]
_OBJECTS = ["an apple.", "the blue sky!", "a red ball?", "fresh bread.", "the café.", "naïve art.",
            "die Straße.", "la crème brûlée.", "日本語の本。", "🎉 a party 🎉", "héllo wörld.", "водку."]


def training_sentences() -> list[str]:
    """Deterministic short sentences: every subject × verb × object (~1,400 lines)."""
    return [f"{s} {v} {o}" for s, v, o in itertools.product(_SUBJECTS, _VERBS, _OBJECTS)]


def make_test_tokenizer(tmp_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Train the test tokenizer, save it to `tmp_dir` (loadable with AutoTokenizer) and return it."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False so decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        # All 256 byte symbols, so any text (emoji, CJK) encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_sentences(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    hf_tok.save_pretrained(os.fspath(tmp_dir))
    return hf_tok
