"""LoRA adapters on a tensor-parallel engine (TP=2 over gloo, two processes on the CPU).

Each rank holds its slice of every adapter (column-parallel qkv/gate_up: B's rows of its heads and features;
row-parallel o/down: A's columns, the partial products summed by the layer's all-reduce). Two real PEFT
adapters on the bundled kiln-tiny-code (6 query heads, 2 KV heads: one KV head a rank), one on q/k/v/o and
one on every linear, and the base model in one batch: greedy tokens and logprobs equal PEFT's float32 model.
The ranks learn an adapter from its first request (`distributed/lora_sync.py`); one they refuse is a
ValueError naming it, and the engine goes on.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import transformers
from lora_util import make_adapter, peft_greedy

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, LoRARequest, SamplingParams
from kiln.runtime.distributed.lora_sync import (
    LoRADrop,
    RankZeroLoRA,
    apply_on_worker,
    encode_drop,
    encode_lora,
    refusal_error,
)
from kiln.runtime.distributed.step_codec import StepDecoder
from kiln.runtime.distributed.wire_checks import StepCodecError

peft = pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n"]
MAX_TOKENS = 8
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def tp2_engine(tmp_path_factory):
    """kiln-tiny-code built for two ranks, float32 (exact comparisons on the CPU)."""
    return build_engine(BUNDLED, tmp_path_factory.mktemp("lora-tp") / "tp2",
                        BuildConfig(dtype="float32", tp_size=2, max_batch_size=16, max_num_tokens=512), progress=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(LoRARequests by id (0: the base model), expected (tokens, logprobs) per (prompt, id))."""
    root = tmp_path_factory.mktemp("lora-tp-adapters")
    base = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    dirs = {1: make_adapter(base, root / "qkvo", 11, r=8, lora_alpha=16, target_modules=QKVO)[0],
            2: make_adapter(base, root / "all", 12, r=16, lora_alpha=8, use_rslora=True,
                            target_modules="all-linear")[0]}
    expected = peft_greedy(base, dirs, PROMPTS, transformers.AutoTokenizer.from_pretrained(BUNDLED), MAX_TOKENS)
    loras = {0: None, 1: LoRARequest("qkvo", 1, str(dirs[1])), 2: LoRARequest("all", 2, str(dirs[2]))}
    return loras, expected


def test_tp2_adapters_and_base_in_one_batch_match_peft(tp2_engine, setup, tmp_path):
    """One device slot and one host place for two adapters (they swap on both ranks; what rank 0 evicts from
    host memory rank 1 forgets, and reads again when it is named again), a tight KV cache and small steps; a
    bad adapter is refused by name and the same engine goes on serving."""
    loras, expected = setup
    cases = [(p, lora_id) for p in range(len(PROMPTS)) for lora_id in (0, 1, 2)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    with LLM(tp2_engine, enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=1, num_kv_blocks=8,
             max_num_tokens=16) as llm:
        outs = llm.generate([PROMPTS[p] for p, _ in cases], params, [loras[i] for _, i in cases])
        for (p, lora_id), out in zip(cases, outs):
            tokens, logprobs = expected[p, lora_id]
            assert out.token_ids == tokens, (p, lora_id)
            assert out.logprobs == pytest.approx(logprobs, abs=2e-3), (p, lora_id)
        assert llm.engine.executor.runner.lora.num_loads > 2  # the adapters took turns in the slot

        (tmp_path / "bad").mkdir()
        with pytest.raises(ValueError, match=r"LoRA adapter 'bad' \(lora_int_id=3.*has no adapter_config.json"):
            llm.generate("x = 1", SamplingParams(max_tokens=1), LoRARequest("bad", 3, str(tmp_path / "bad")))
        with pytest.raises(ValueError, match="lora_int_id=1 already names"):
            llm.generate("x = 1", SamplingParams(max_tokens=1), LoRARequest("other", 1, str(tmp_path / "bad")))
        ranks = llm.engine.executor._lora
        for lora_id in (1, 2, 1):  # the engine goes on; each adapter named again evicts the other everywhere
            again = llm.generate(PROMPTS[1], params, loras[lora_id])[0]
            assert again.token_ids == expected[1, lora_id][0]
            assert ranks.held == {lora_id} and llm.lora_stats()["host_adapters"] == 1
        stats = llm.kv_cache_stats()
        assert stats["free_blocks"] == stats["total_blocks"] and stats["num_waiting"] == 0


# ---- the lora messages and the ranks' agreement, without processes -------------------------------------

class _Slots:
    """What lora_sync uses of LoRASlots: held adapters (host memory) and pins."""

    def __init__(self, fail: str = "") -> None:
        self.known: set[int] = set()
        self.host: set[int] = set()
        self.pins: set[int] = set()
        self.fail = fail

    def knows(self, lora_int_id):
        return lora_int_id in self.known

    def holds(self, lora_int_id):
        return lora_int_id in self.host

    def register(self, request, adapter=None):
        if self.fail:
            raise ValueError(self.fail)
        self.known.add(request.lora_int_id)
        self.host.add(request.lora_int_id)

    def pin(self, lora_int_id):
        self.pins.add(lora_int_id)

    def discard(self, lora_int_id):
        self.known.discard(lora_int_id)
        self.host.discard(lora_int_id)
        self.pins.discard(lora_int_id)


class _Ranks:
    """Rank 0's RankZeroLoRA over fake worker ranks, each in a thread per message; gather is a real barrier."""

    def __init__(self, *workers: _Slots) -> None:
        self.workers = workers
        self.decoders = [StepDecoder() for _ in workers]
        self.sent: list[dict] = []
        self.rank0 = RankZeroLoRA(_Slots(), self._send, self._gather_rank0)
        self._texts: list[str] = []
        self._barrier = threading.Barrier(len(workers) + 1)
        self._threads: list[threading.Thread] = []

    def _gather(self, rank: int, text: str) -> list[str]:
        self._texts[rank] = text
        self._barrier.wait(10)
        return list(self._texts)

    def _gather_rank0(self, text: str) -> list[str]:
        texts = self._gather(0, text)
        for thread in self._threads:
            thread.join(10)
        return texts

    def _send(self, data: bytes) -> None:
        self.sent.append(json.loads(data))
        self._texts = [""] * (len(self.workers) + 1)
        self._threads = [threading.Thread(target=apply_on_worker, args=(
            slots, decoder.decode(data), lambda text, r=rank: self._gather(r, text)))
            for rank, (slots, decoder) in enumerate(zip(self.workers, self.decoders), 1)]
        for thread in self._threads:
            thread.start()
        if self.sent[-1]["kind"] == "lora_drop":  # no reply
            for thread in self._threads:
                thread.join(10)


def test_lora_messages_round_trip_and_refusals():
    request = LoRARequest("sql", 7, "/adapters/sql")
    assert StepDecoder().decode(encode_lora(request)) == request
    assert StepDecoder().decode(encode_drop([9, 3])) == LoRADrop((3, 9))
    good = json.loads(encode_lora(request))
    for change, field in [({"id": 0}, "'id'=0"), ({"id": True}, "'id' must be an integer"),
                          ({"path": ""}, "'path'"), ({"name": 3}, "'name'"), ({"extra": 1}, "unexpected field")]:
        with pytest.raises(StepCodecError, match=field):
            StepDecoder().decode(json.dumps({**good, **change}).encode())
    with pytest.raises(StepCodecError, match=r"'ids'\[0\]=0 is out of range"):
        StepDecoder().decode(json.dumps({"kind": "lora_drop", "v": 1, "ids": [0]}).encode())


def test_ranks_hold_an_adapter_all_or_none_and_forget_what_rank0_evicts():
    ok, refusing = _Slots(), _Slots()
    ranks = _Ranks(ok, refusing)
    sql = LoRARequest("sql", 7, "/adapters/sql")
    refusing.fail = "/adapters/sql does not exist"
    with pytest.raises(ValueError, match=r"^rank 2: /adapters/sql does not exist$"):
        ranks.rank0.add(sql, None)
    assert not ranks.rank0.slots.knows(7) and not ok.knows(7) and ranks.rank0.held == set()  # held by none
    refusing.fail = ""
    ranks.rank0.add(sql, None)
    ranks.rank0.add(sql, None)  # held everywhere: rank 0 alone, nothing sent
    assert [m["kind"] for m in ranks.sent] == ["lora", "lora"]
    assert ok.pins == refusing.pins == {7} and ranks.rank0.held == {7}  # the others never evict on their own
    ranks.rank0.slots.host.discard(7)  # rank 0 evicts it: the others forget it too
    ranks.rank0.sync_drops()
    assert ranks.sent[-1] == {"kind": "lora_drop", "v": 1, "ids": [7]} and not ok.knows(7) and not refusing.pins
    ranks.rank0.add(sql, None)  # named again: sent again
    assert ranks.sent[-1]["kind"] == "lora" and ok.holds(7) and refusing.holds(7)
    assert str(refusal_error([(1, "no"), (2, "no"), (3, "bad")])) == "ranks 1, 2: no; rank 3: bad"


def test_tp2_async_llm_reads_off_the_engine_thread_and_the_ranks_follow(tp2_engine, setup):
    """AsyncLLM reads an adapter on a worker thread (rank 0's whole copy) and admits it on the engine thread,
    which sends it to rank 1."""
    import asyncio

    from kiln.runtime import AsyncLLM

    loras, expected = setup
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = AsyncLLM(tp2_engine, enable_lora=True, max_lora_rank=16)

    async def run(prompt, lora):
        return [out async for out in llm.generate(prompt, params, lora_request=lora)][-1].token_ids

    async def main():
        return await asyncio.gather(*(run(PROMPTS[p], loras[i]) for p in (0, 2) for i in (0, 1, 2)))

    try:
        assert asyncio.run(main()) == [expected[p, i][0] for p in (0, 2) for i in (0, 1, 2)]
        assert llm.engine.executor._lora.held == {1, 2}
    finally:
        llm.shutdown()
