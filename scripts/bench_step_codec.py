"""Host time to send one tensor-parallel step: pickle (what the ranks used to get) against the JSON step codec
(`kiln.runtime.distributed.step_codec`), for decode steps of a batch of requests.

    python scripts/bench_step_codec.py [--batch 256] [--blocks 8 64 512] [--steps 64] [--rounds 5]

Each request decodes one token a step with a block table of `blocks` blocks that gains a block every 16 steps
(block_size 16), as in steady decoding; `steps` consecutive steps are encoded and decoded, pickle and the codec
interleaved in one process, and the best of `rounds` is printed per step (encode on rank 0, decode on a rank).
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

from kiln.runtime.core.block_table import BlockTable, new_stamp
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.distributed.step_codec import StepDecoder, StepEncoder
from kiln.runtime.worker.model_step import StepInput


def decode_steps(batch: int, blocks: int, count: int) -> list[StepInput]:
    lists = [list(range(i * 100_000, i * 100_000 + blocks)) for i in range(batch)]
    stamps = [new_stamp() for _ in range(batch)]
    steps = []
    for s in range(count):
        requests = []
        for i, ids in enumerate(lists):
            if (s + i) % 16 == 0:
                ids.append(ids[-1] + 1)
            requests.append(ScheduledRequest(f"req-{i}", (random.randrange(32000),), len(ids) * 16 - 3,
                                             BlockTable(ids, len(ids), stamps[i]), 200, 1))
        steps.append(StepInput(SchedulerOutput(tuple(requests), ())))
    return steps


def measure(batch: int, blocks: int, count: int, rounds: int) -> None:
    best: dict[str, float] = {}
    for _ in range(rounds):
        steps = decode_steps(batch, blocks, count)
        t0 = time.perf_counter()
        pickled = [pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL) for s in steps]
        t1 = time.perf_counter()
        for data in pickled:
            pickle.loads(data)
        t2 = time.perf_counter()
        encoder, decoder = StepEncoder(), StepDecoder()
        encoded = [encoder.encode(s) for s in steps]
        t3 = time.perf_counter()
        decoded = [decoder.decode(data) for data in encoded]
        t4 = time.perf_counter()
        assert decoded == steps
        for name, seconds in (("pickle encode", t1 - t0), ("pickle decode", t2 - t1), ("codec encode", t3 - t2),
                              ("codec decode", t4 - t3)):
            best[name] = min(best.get(name, float("inf")), seconds / count * 1e6)
    size = (sum(map(len, pickled)) // count, sum(map(len, encoded)) // count)
    print(f"batch {batch}, {blocks} blocks a table: " + ", ".join(f"{k} {v:.0f} us" for k, v in best.items())
          + f"; bytes a step: pickle {size[0]}, codec {size[1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for blocks in args.blocks:
        measure(args.batch, blocks, args.steps, args.rounds)


if __name__ == "__main__":
    main()
