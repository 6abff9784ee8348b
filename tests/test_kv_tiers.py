"""The tiered KV cache end to end on the CPU (the bundled model): prefixes evicted from a small device pool come
back from the host tier and from the disk tier, across a restart, with outputs identical to recomputing them;
bad block files are recomputed; every tier stays within its size and every block returns to its pool."""

import json
import urllib.request

import pytest

from kiln.runtime import LLM, SamplingParams

BLOCKS = 24  # device blocks of 16 tokens: a few prompts fill the pool
HOST_GIB = 12 / 1024  # 12 MiB of host slots (~96 blocks of the bundled model in float32)


def prompts(tokenizer, n, shared_len=80):
    """`n` prompts with distinct ~80-token prefixes and a short tail each."""
    out = []
    for k in range(n):
        head = " ".join(f"def f{k}_{i}(x): return x + {i * k}" for i in range(40))
        ids = tokenizer.encode(head)[:shared_len]
        out.append(ids + tokenizer.encode(f"\n# case {k}\n"))
    return out


def run(llm, token_prompts, params):
    return [o.token_ids for o in llm.generate([list(p) for p in token_prompts], params)]


def counted(llm):
    """Counts the prompt tokens the engine computes (the executor's scheduled tokens)."""
    executor = llm.engine.executor
    seen = {"tokens": 0}
    execute = executor.execute

    def wrapper(step):
        seen["tokens"] += step.schedule.num_tokens
        return execute(step)

    executor.execute = wrapper
    return seen


@pytest.fixture(scope="module")
def reference(tiny_code_engine):
    """Outputs without any tier (and a pool large enough never to evict)."""
    llm = LLM(tiny_code_engine)
    yield llm
    llm.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=6)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_evicted_prefixes_come_back_from_the_host_tier(tiny_code_engine, reference, params):
    llm = LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=HOST_GIB)
    try:
        ps = prompts(llm.engine.tokenizer, 8)
        expected = run(reference, ps, params)
        assert [run(llm, [p], params)[0] for p in ps] == expected  # one at a time: each evicts the ones before
        computed = counted(llm)
        outs = [llm.generate(p, params)[0] for p in ps[:3]]
        assert [o.token_ids for o in outs] == expected[:3]
        for out in outs:
            assert out.metrics.num_cached_tokens_host >= 64 and out.num_cached_tokens == \
                out.metrics.num_cached_tokens_host + out.metrics.num_cached_tokens_device
        # Only what the host did not hold was computed: the tails and the generated tokens.
        assert computed["tokens"] <= sum(len(p) - o.num_cached_tokens for p, o in zip(ps, outs)) + 3 * 6
        stats = llm.kv_cache_stats()
        assert stats["free_blocks"] == stats["total_blocks"] == BLOCKS
        assert stats["host_tier_hits"] >= 12 and stats["host_tier_blocks"] <= stats["host_tier_slots"]
    finally:
        llm.shutdown()


def test_identical_under_preemption_and_chunked_prefill(tiny_code_engine, reference):
    # 16 blocks, 32-token steps: prompts are chunked, batches preempt, and prefixes move between the tiers.
    llm = LLM(tiny_code_engine, num_kv_blocks=16, max_num_tokens=32, kv_offloading_size=HOST_GIB)
    try:
        ps = prompts(llm.engine.tokenizer, 6) * 2
        params = SamplingParams(temperature=0.0, max_tokens=24)
        assert run(llm, ps, params) == run(reference, ps, params)
        stats = llm.kv_cache_stats()
        assert stats["num_preemptions"] > 0 and stats["host_tier_hits"] > 0
        assert stats["free_blocks"] == stats["total_blocks"]
    finally:
        llm.shutdown()


def test_a_restart_serves_prefixes_from_disk(tiny_code_engine, reference, tmp_path):
    disk = tmp_path / "kv"
    tiny_host = 2 / 1024  # 2 MiB: the host tier overflows to disk
    llm = LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=tiny_host, kv_offloading_dir=str(disk))
    ps = prompts(llm.engine.tokenizer, 8)
    expected = run(reference, ps, GREEDY)
    assert [run(llm, [p], GREEDY)[0] for p in ps] == expected
    llm.shutdown()  # queued writes finish
    assert list(disk.glob("*.kvb"))

    # A restart: a new engine over the same directory finds the blocks only by scanning it (the first one's
    # tiers and index are gone with it; in this process, not a new one: a Python start costs seconds).
    with LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=tiny_host,
             kv_offloading_dir=str(disk)) as again:
        out = again.generate(ps[0], GREEDY)[0]
        disk_hits = again.kv_cache_stats()["disk_tier_hits"]
    assert out.token_ids == expected[0] and out.metrics.num_cached_tokens_disk >= 64 and disk_hits >= 4


def test_a_flipped_byte_is_recomputed_and_other_engines_ignore_the_files(tiny_code_engine, reference, tmp_path,
                                                                         tiny_code_draft_engine):
    disk = tmp_path / "kv"
    tiny_host = 2 / 1024
    llm = LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=tiny_host, kv_offloading_dir=str(disk))
    ps = prompts(llm.engine.tokenizer, 8)
    expected = run(reference, ps, GREEDY)
    run(llm, ps, GREEDY)
    llm.shutdown()
    for path in disk.glob("*.kvb"):  # every file: whichever the prompt reads first is bad
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40
        path.write_bytes(bytes(data))
    second = LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=tiny_host, kv_offloading_dir=str(disk))
    try:
        out = second.generate(ps[0], GREEDY)[0]
        assert out.token_ids == expected[0] and out.metrics.num_cached_tokens_disk == 0
        assert second.kv_cache_stats()["disk_tier_corrupt"] >= 1
    finally:
        second.shutdown()

    # Another engine (the bundled draft model: other weights and shapes) never loads them.
    third = LLM(tiny_code_draft_engine, num_kv_blocks=BLOCKS, kv_offloading_size=tiny_host,
                kv_offloading_dir=str(disk))
    try:
        out = third.generate(ps[1], GREEDY)[0]
        assert out.metrics.num_cached_tokens_disk == 0
        assert third.kv_cache_stats()["disk_tier_foreign"] > 0
    finally:
        third.shutdown()


def test_the_disk_tier_stays_at_its_limit(tiny_code_engine, tmp_path):
    disk = tmp_path / "kv"
    limit_gib = 1 / 1024  # 1 MiB: a handful of blocks
    llm = LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=1 / 1024, kv_offloading_dir=str(disk),
              kv_offloading_disk_size=limit_gib)
    try:
        run(llm, prompts(llm.engine.tokenizer, 10), GREEDY)
        llm.engine.kv_tiers.disk.flush()
        assert 0 < sum(p.stat().st_size for p in disk.glob("*.kvb")) <= limit_gib * 2**30
        stats = llm.kv_cache_stats()
        assert stats["disk_tier_evictions"] > 0 and stats["host_tier_blocks"] <= stats["host_tier_slots"]
    finally:
        llm.shutdown()


def test_openai_usage_and_prometheus_name_the_cached_tokens(tiny_code_engine):
    from serve_util import start_server

    srv = start_server(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=HOST_GIB)
    try:
        def complete(prompt):
            body = json.dumps({"model": "kiln-tiny-code", "prompt": prompt, "max_tokens": 2,
                               "temperature": 0}).encode()
            request = urllib.request.Request(f"{srv.http_base}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            return json.load(urllib.request.urlopen(request))["usage"]

        prompt = " ".join(f"x{i} = {i}" for i in range(60))
        assert complete(prompt)["prompt_tokens_details"]["cached_tokens"] == 0
        again = complete(prompt)
        assert again["prompt_tokens_details"]["cached_tokens"] >= 16
        metrics = urllib.request.urlopen(srv.metrics_url).read().decode()
        assert 'kiln_kv_tier_blocks{tier="host"}' in metrics
        assert 'kiln_kv_tier_copy_seconds_total{direction="device_to_host"}' in metrics
    finally:
        srv.stop()


@pytest.mark.parametrize("output_kind", ["cumulative", "delta"])
def test_async_llm_reports_the_host_tier_in_every_update(tiny_code_engine, reference, output_kind):
    import asyncio
    import dataclasses

    from kiln.runtime import AsyncLLM

    llm = AsyncLLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=HOST_GIB)
    params = dataclasses.replace(GREEDY, output_kind=output_kind)

    async def main(ps):
        outs = []
        for p in ps + ps[:1]:  # the first prefix comes back from the host tier at the end
            outs.append([out async for out in llm.generate(p, params)])
        return outs

    try:
        ps = prompts(llm.tokenizer, 6)
        streams = asyncio.run(main(ps))
    finally:
        llm.shutdown()
    last = streams[-1]
    assert [t for out in last for t in out.token_ids][-6:] == run(reference, ps[:1], GREEDY)[0]
    assert all(out.metrics.num_cached_tokens_host >= 64 for out in last)


def test_speculative_decoding_hashes_only_accepted_tokens(tiny_code_engine, reference):
    llm = LLM(tiny_code_engine, num_kv_blocks=BLOCKS, kv_offloading_size=HOST_GIB,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        ps = prompts(llm.engine.tokenizer, 6)
        params = SamplingParams(temperature=0.0, max_tokens=24)
        expected = run(reference, ps, params)
        assert [run(llm, [p], params)[0] for p in ps + ps[:2]] == expected + expected[:2]
        assert llm.kv_cache_stats()["host_tier_hits"] > 0
    finally:
        llm.shutdown()


def test_an_fp8_kv_cache_moves_its_blocks_as_they_are(tmp_path):
    """FP8 weights and KV cache (dummy weights, per-layer scales fixed by the engine): the host tier's blocks come
    back byte for byte, so the tokens equal recomputing."""
    from serve_util import EXAMPLES

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    engine = build_engine(EXAMPLES / "kiln-tiny-code", tmp_path / "fp8",
                          BuildConfig(dtype="float32", qformat="fp8", kv_cache_dtype="fp8", dummy_weights=True,
                                      max_batch_size=4, max_num_tokens=256), progress=False)
    with LLM(engine) as plain:
        ps = prompts(plain.engine.tokenizer, 6)
        expected = run(plain, ps, GREEDY)
    with LLM(engine, num_kv_blocks=BLOCKS, kv_offloading_size=HOST_GIB) as llm:
        assert [run(llm, [p], GREEDY)[0] for p in ps + ps[:2]] == expected + expected[:2]
        assert llm.kv_cache_stats()["host_tier_hits"] > 0
