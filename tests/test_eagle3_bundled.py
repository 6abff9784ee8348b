"""The bundled EAGLE-3 head (`examples/kiln-tiny-code-eagle3`, trained by scripts/train_eagle3.py) over the
bundled model: it loads through the proposer exactly as a published head does, greedy output with it equals
greedy output without speculation on held-out code, and its drafts are accepted."""

from __future__ import annotations

import json

from serve_util import EXAMPLES

from kiln.bench.offline import text_prompts
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.speculative import SpeculativeConfig

HEAD = EXAMPLES / "kiln-tiny-code-eagle3"


def test_bundled_head_is_the_published_layout():
    config = json.loads((HEAD / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    target = json.loads((EXAMPLES / "kiln-tiny-code" / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"]) == (target["hidden_size"], target["vocab_size"])
    assert (HEAD / "model.safetensors").stat().st_size < 16e6  # one decoder layer, bfloat16
    assert json.loads((HEAD / "training.json").read_text())["steps"] > 0


def test_bundled_head_is_exact_and_accepted(tiny_code_engine):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(tiny_code_engine, num_kv_blocks=64) as plain:
        ids = list(plain.tokenizer.encode((EXAMPLES / "heldout-sample.txt").read_text()))
        prompts = text_prompts(ids, 2, 48, seed=1)
        reference = [o.token_ids for o in plain.generate(prompts, params)]
    lengths = []
    for topk, nodes in ((1, None), (2, 8)):  # a chain, then a tree
        config = SpeculativeConfig("eagle3", 4, model=str(HEAD), eagle_topk=topk, num_draft_tokens=nodes)
        with LLM(tiny_code_engine, num_kv_blocks=64, speculative_config=config) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params)] == reference
            stats = llm.speculation_stats()
        assert stats["num_accepted_tokens"] > 0
        lengths.append(stats["mean_accepted_length"])
    # a trained head (3.15 as a chain, 3.57 as a 2 x 8 tree at K = 4 on the table), not a random one (~1.05)
    assert lengths[0] > 1.5 and lengths[1] >= lengths[0]
