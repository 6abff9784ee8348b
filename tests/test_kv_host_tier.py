"""The host tier of the KV cache (worker/kv_host_tier.py): device <-> host copies of whole blocks, the options
that size it, and how they reach the runner on every rank."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from kiln.model_defs import ModelConfig
from kiln.model_defs.config import RopeConfig
from kiln.runtime.core.kv_tiers import NO_TRANSFERS, KVTransfers
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.distributed.step_codec import StepCodecError, StepDecoder, StepEncoder
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.worker.kv_cache import KVCache
from kiln.runtime.worker.kv_host_tier import HostKVTier, host_tier_for, slot_bytes_of
from kiln.runtime.worker.memory import MemoryReport
from kiln.runtime.worker.model_step import StepInput

BS = 4
CONFIG = ModelConfig("LlamaForCausalLM", 32, 8, 16, 3, 4, 2, 8, 1e-6, 64, RopeConfig())  # 3 layers, Hk 2, D 8


def filled_cache(dtype: torch.dtype = torch.float32, num_blocks: int = 10, device: str = "cpu") -> KVCache:
    """A cache whose every block holds distinct values."""
    scales = [(0.5, 0.25)] * CONFIG.num_layers if dtype in (torch.float8_e4m3fn, torch.int8) else None
    cache = KVCache(CONFIG, num_blocks, BS, dtype, torch.device(device), scales)
    values = torch.randn(cache.storage.shape, device=device) * 4
    cache.storage.copy_(values.to(torch.int8) if dtype == torch.int8 else values.to(dtype))
    return cache


def block(cache: KVCache, b: int) -> torch.Tensor:
    """Block b over every layer's keys and values, as bytes: [L, 2, BS, Hk, D * element size]."""
    return cache.storage[:, :, b].contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_offloaded_blocks_come_back_byte_for_byte(dtype):
    cache = filled_cache(dtype)
    tier = HostKVTier(cache, num_slots=6, chunk_blocks=2)  # chunks of 2: several staging rounds
    assert tier.slots.shape == (6, CONFIG.num_layers, 2, BS, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert tier.slots.dtype == dtype and tier.slot_bytes == slot_bytes_of(cache) == tier.nbytes // 6
    assert tier.slot_bytes == KVCache.bytes_per_block(CONFIG, BS, dtype)
    assert tier.slots.untyped_storage().data_ptr() != cache.storage.untyped_storage().data_ptr()
    before = {b: block(cache, b) for b in range(10)}
    offloads = ((7, 0), (2, 1), (3, 2), (9, 5), (0, 4))  # consecutive slot runs and not
    tier.apply(KVTransfers(offloads=offloads))
    for b, slot in offloads:
        assert torch.equal(tier.slots[slot].view(torch.uint8), before[b])
    cache.storage.zero_()  # the device blocks are reused by others
    loads = ((0, 1), (1, 8), (2, 9), (5, 3), (4, 4))
    tier.apply(KVTransfers(loads=loads))
    for slot, b in loads:
        source = offloads[[s for _, s in offloads].index(slot)][0]
        assert torch.equal(block(cache, b), before[source])
    for untouched in (0, 2, 5, 6, 7):
        assert not block(cache, untouched).any()
    stats = tier.stats()
    assert stats["offloaded_blocks"] == stats["loaded_blocks"] == 5
    assert stats["offloaded_bytes"] == stats["loaded_bytes"] == 5 * tier.slot_bytes
    assert stats["offload_seconds"] >= 0 and stats["load_seconds"] >= 0 and stats["num_slots"] == 6


def test_offloads_and_loads_of_one_step_and_wait_for_offloads():
    """One step offloads blocks 1, 2 and hands block 2 out again (wait_for_offloads), loading slot 0 into it:
    the offloads read the blocks before the loads write them."""
    cache = filled_cache()
    tier = HostKVTier(cache, num_slots=3)
    b1, b2, b5 = block(cache, 1), block(cache, 2), block(cache, 5)
    tier.apply(KVTransfers(offloads=((5, 0),)))
    tier.apply(KVTransfers(offloads=((1, 1), (2, 2)), loads=((0, 2),), wait_for_offloads=True))
    assert torch.equal(tier.slots[1].view(torch.uint8), b1) and torch.equal(tier.slots[2].view(torch.uint8), b2)
    assert torch.equal(block(cache, 2), b5)
    tier.apply(NO_TRANSFERS)  # every step calls it: nothing to copy
    assert tier.stats()["offloaded_blocks"] == 3


def test_read_and_write_slot_round_trip():
    cache = filled_cache(torch.bfloat16)
    tier = HostKVTier(cache, num_slots=4)
    tier.apply(KVTransfers(offloads=((3, 1),)))
    data = bytes(tier.read_slot(1))
    assert len(data) == tier.slot_bytes and data == block(cache, 3).numpy().tobytes()
    tier.write_slot(2, data)  # as the disk tier does when it reads a block file back
    tier.write_slot(0, bytearray(tier.slot_bytes))
    tier.apply(KVTransfers(loads=((2, 7), (0, 8))))
    assert torch.equal(block(cache, 7), block(cache, 3)) and not block(cache, 8).any()
    with pytest.raises(ValueError, match=f"holds {tier.slot_bytes} bytes, got a payload of 3"):
        tier.write_slot(0, b"abc")
    with pytest.raises(ValueError, match=r"host KV slot 4 is outside \[0, 4\)"):
        tier.read_slot(4)


def test_transfers_out_of_range_are_refused():
    tier = HostKVTier(filled_cache(num_blocks=4), num_slots=2)
    with pytest.raises(ValueError, match=r"offloads name a device block outside \[0, 4\)"):
        tier.apply(KVTransfers(offloads=((4, 0),)))
    with pytest.raises(ValueError, match=r"loads name a host slot outside \[0, 2\)"):
        tier.apply(KVTransfers(loads=((2, 0),)))


def test_sizing_from_bytes():
    cache = filled_cache()
    slot = slot_bytes_of(cache)
    assert host_tier_for(cache, 0) is None
    assert host_tier_for(cache, 5 * slot + slot // 2).num_slots == 5
    with pytest.raises(ValueError, match=rf"kv_offloading_size \(--kv-offloading-size\).*less than one KV block "
                                         rf"\({slot} bytes"):
        host_tier_for(cache, slot - 1)
    with pytest.raises(ValueError, match="kv_offloading_size .* this host has"):
        HostKVTier(cache, num_slots=2**50 // slot)


def test_memory_report_names_the_host_tier():
    report = MemoryReport("cpu", 0, 1, 0, 2**30, 0, 64, 16, 128, 0.9, host_tier_bytes=2**31, host_tier_blocks=100)
    assert "host KV tier 2.00 GiB (100 blocks = 1600 tokens)" in report.summary()
    assert "host KV tier" not in MemoryReport("cpu", 0, 1, 0, 2**30, 0, 64, 16, 128, 0.9).summary()


# ---- the options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, error", [
    ({"kv_offloading_size": -1}, r"kv_offloading_size=-1 must be a finite number of GiB, at least 0"),
    ({"kv_offloading_size": "2"}, r"kv_offloading_size='2' must be a finite number"),
    ({"kv_offloading_size": float("inf")}, r"kv_offloading_size=inf must be a finite number"),
    ({"kv_offloading_size": True}, r"kv_offloading_size=True must be"),
    ({"kv_offloading_disk_size": 0}, r"kv_offloading_disk_size=0 must be a finite number of GiB, above 0"),
    ({"kv_offloading_disk_size": -2.5}, r"kv_offloading_disk_size=-2.5 must be"),
    ({"kv_offloading_dir": "/tmp/kv"}, r"kv_offloading_dir='/tmp/kv' needs kv_offloading_size > 0.*"
                                       r"--kv-offloading-dir needs --kv-offloading-size"),
    ({"kv_offloading_size": 1, "kv_offloading_dir": 3}, r"kv_offloading_dir=3 must be a directory path"),
])
def test_bad_offloading_options_name_the_field(changes, error):
    with pytest.raises(ValueError, match=error):
        RuntimeOptions(**changes)


def test_offloading_options_and_flags(tmp_path):
    from kiln.commands.runtime_args import add_runtime_args, runtime_options

    options = RuntimeOptions(kv_offloading_size=2, kv_offloading_dir=tmp_path, kv_offloading_disk_size=1)
    assert (options.kv_offloading_size, options.kv_offloading_dir, options.kv_offloading_disk_size) == (
        2.0, str(tmp_path), 1.0)
    assert RuntimeOptions().kv_offloading_size == 0.0 and RuntimeOptions().kv_offloading_dir is None
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    assert "--kv-offloading-size" in parser.format_help() and "--kv-offloading-disk-size" in parser.format_help()
    args = parser.parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-dir", str(tmp_path)])
    parsed = runtime_options(args)
    assert (parsed.kv_offloading_size, parsed.kv_offloading_dir, parsed.kv_offloading_disk_size) == (
        0.5, str(tmp_path), 10.0)


def test_triton_repository_passes_the_tiers_on(tiny_code_engine, tmp_path, capsys):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from kiln.cli import main
    from kiln.serve.tritonserver.repository import BackendParameters

    argv = ["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path / "repo"), "--model-name", "m"]
    assert main([*argv, "--kv-cache-host-memory-bytes", str(2**30), "--kv-offloading-dir", "kv",
                 "--kv-offloading-disk-size", "2"]) == 0
    config = text_format.Parse((tmp_path / "repo" / "m" / "config.pbtxt").read_text(), mc.ModelConfig())
    values = {k: v.string_value for k, v in config.parameters.items()}
    assert (values["kv_cache_host_memory_bytes"], values["kv_offloading_disk_size"]) == (str(2**30), "2.0")
    assert values["kv_offloading_dir"] == str(Path("kv").resolve())  # tritonserver runs elsewhere
    assert BackendParameters.from_strings(values).offloading_options() == {
        "kv_offloading_size": 1.0, "kv_offloading_dir": str(Path("kv").resolve()), "kv_offloading_disk_size": 2.0}
    capsys.readouterr()
    assert main([*argv, "--force", "--kv-offloading-dir", "kv"]) == 2
    kv = str(Path("kv").resolve())
    assert f"kv_offloading_dir={kv!r} needs kv_cache_host_memory_bytes > 0" in capsys.readouterr().err
    assert main([*argv, "--force", "--kv-cache-host-memory-bytes", "1", "--kv-offloading-disk-size", "0"]) == 2
    assert "kv_offloading_disk_size=0.0 must be" in capsys.readouterr().err


# ---- the wire to the other ranks ---------------------------------------------------------------------------
def test_transfers_cross_the_step_channel():
    request = ScheduledRequest("a", (1, 2), 0, (4, 5), 2, 1)
    transfers = KVTransfers(offloads=((3, 0), (9, 7)), loads=((2, 4),), wait_for_offloads=True)
    encoder, decoder = StepEncoder(), StepDecoder()
    for kv in (transfers, NO_TRANSFERS, KVTransfers(loads=((0, 1),))):
        step = StepInput(SchedulerOutput((request,), (), (), kv))
        got = decoder.decode(encoder.encode(step))
        assert got == step and got.schedule.kv_transfers == kv
    assert json.loads(encoder.encode(StepInput(SchedulerOutput((), ()))))["kv"] is None


@pytest.mark.parametrize("kv, error", [
    ([[1, 2, 3], [], False], r"'kv'\[0\] \(offloads\) has 3 entries"),
    ([[1, -2], [], False], r"'kv'\[0\] \(offloads\)\[1\]=-2 is out of range"),
    ([[], [1.5, 2], False], r"'kv'\[1\] \(loads\)\[0\] must be an integer"),
    ([[], [], 1], r"'kv' must be null or \[offload pairs, load pairs, wait_for_offloads\]"),
    ({"offloads": []}, r"'kv' must be null or"),
])
def test_bad_transfers_on_the_wire_are_refused(kv, error):
    message = json.loads(StepEncoder().encode(StepInput(SchedulerOutput((), ()))))
    message["kv"] = kv
    with pytest.raises(StepCodecError, match=error):
        StepDecoder().decode(json.dumps(message).encode())


def test_start_message_carries_the_offloading_options():
    from kiln.runtime.distributed.launch import RankLaunch
    from kiln.runtime.distributed.step_codec import decode_start, encode_start
    from kiln.runtime.worker.engine_loader import RuntimeConfig

    runtime = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32, max_batch_size=2, max_num_tokens=16,
                            max_seq_len=64, block_size=4, num_kv_blocks=None, enable_prefix_caching=True,
                            kv_offloading_size=1.5, kv_offloading_dir="/data/kv", kv_offloading_disk_size=3.0)
    launch = RankLaunch(1, 2, "127.0.0.1", 29500, 1, 2, external=False)
    assert decode_start(encode_start("e", runtime, launch, None, 20))[1] == runtime
    assert runtime.host_kv_bytes(2) == 3 * 2**28  # 0.75 GiB a rank


# ---- the runner --------------------------------------------------------------------------------------------
def test_an_engine_with_kv_offloading_size_has_host_slots(tiny_code_engine):
    from kiln.runtime.worker.engine_loader import load_engine
    from kiln.runtime.worker.executor import LocalExecutor

    loaded, runtime = load_engine(tiny_code_engine, kv_offloading_size=0.001, num_kv_blocks=8)
    executor = LocalExecutor(loaded.model, runtime)
    tier = executor.host_kv_tier
    assert executor.num_host_kv_blocks == tier.num_slots == int(0.001 * 2**30) // tier.slot_bytes > 0
    assert executor.memory_report.host_tier_blocks == tier.num_slots
    cache = executor.runner.kv_cache
    cache.storage[:, :, 3].normal_()
    saved = block(cache, 3)
    requests = (ScheduledRequest("a", (5, 6), 0, (1,), 2, 1),)  # a prompt in block 1
    executor.execute(StepInput(SchedulerOutput(requests, (), (), KVTransfers(offloads=((3, 0),)))))
    executor.execute(StepInput(SchedulerOutput(requests, (), (), KVTransfers(loads=((0, 6),)))))
    assert torch.equal(block(cache, 6), saved)
    executor.execute(StepInput(SchedulerOutput(requests, ())))

    loaded, runtime = load_engine(tiny_code_engine, num_kv_blocks=8)
    plain = LocalExecutor(loaded.model, runtime)
    assert plain.num_host_kv_blocks == 0 and plain.host_kv_tier is None
    with pytest.raises(ValueError, match="no host KV tier .*--kv-offloading-size"):
        plain.execute(StepInput(SchedulerOutput(requests, (), (), KVTransfers(loads=((0, 1),)))))


def test_every_tensor_parallel_rank_holds_a_tier_and_applies_the_transfers(tmp_path):
    from model_factory import make_checkpoint

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig
    from kiln.runtime import LLM

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2), progress=False)
    with LLM(engine, kv_offloading_size=0.0005, num_kv_blocks=16) as llm:
        executor = llm.engine.executor
        cache = executor.runner.kv_cache  # rank 0's shard
        slots = int(0.0005 * 2**30) // 2 // slot_bytes_of(cache)  # each rank its half
        assert executor.num_host_kv_blocks == slots > 0 and executor.host_kv_tier is None
        cache.storage[:, :, 3].normal_()
        saved = block(cache, 3)
        requests = (ScheduledRequest("a", (5, 6), 0, (1,), 2, 1),)
        executor.execute(StepInput(SchedulerOutput(requests, (), (), KVTransfers(offloads=((3, 0),)))))
        executor.execute(StepInput(SchedulerOutput(requests, (), (), KVTransfers(loads=((0, 9),)))))
        assert torch.equal(block(cache, 9), saved)
        # Rank 1 checks and applies them too: a slot it does not have stops the engine, naming rank 1.
        executor.runner.host_tier.apply = lambda transfers: None
        with pytest.raises(Exception, match=rf"rank 1 failed: ValueError: KV transfers: loads name a host slot "
                                            rf"outside \[0, {slots}\)"):
            executor.execute(StepInput(SchedulerOutput(requests, (), (), KVTransfers(loads=((slots, 9),)))))


# ---- CUDA: the copy stream -----------------------------------------------------------------------------------
def overlap_and_reuse(device: str, matmul_size: int) -> None:
    """Offloads queued behind long matmuls and a cache write on the compute stream read the blocks as that
    write left them; the next step overwrites the offloaded blocks (ordered after the copies) and loads them back
    elsewhere: bytes equal."""
    cache = filled_cache(torch.bfloat16, num_blocks=64, device=device)
    tier = HostKVTier(cache, num_slots=48, chunk_blocks=8)
    assert tier.slots.is_pinned() == (device == "cuda")
    source = torch.randn_like(cache.storage[:, :, :32])  # [L, 2, 32, BS, Hk, D]
    expected = {b: source[:, :, b].contiguous().view(torch.uint8).cpu() for b in range(32)}
    a = torch.randn(matmul_size, matmul_size, device=device) / matmul_size
    for _ in range(8):  # keep the compute stream busy
        a = a @ a
    cache.storage[:, :, :32].copy_(source)  # queued before the offload: the copies must see it
    offloads = tuple((b, (b * 5) % 48) for b in range(32))  # runs of one slot and of several
    tier.apply(KVTransfers(offloads=offloads))
    tier.apply(KVTransfers())  # the next step: compute waits on the copies before it writes
    cache.storage[:, :, :32].zero_()
    tier.apply(KVTransfers(loads=tuple((slot, 32 + b) for b, slot in offloads)))
    for b, _ in offloads:
        assert torch.equal(block(cache, 32 + b).cpu(), expected[b])
    assert bytes(tier.read_slot(offloads[3][1])) == expected[3].numpy().tobytes()
    if device == "cuda":
        torch.cuda.synchronize()
    stats = tier.stats()
    assert stats["offloaded_blocks"] == stats["loaded_blocks"] == 32 and stats["offload_seconds"] > 0


def test_overlap_and_reuse_on_the_cpu():
    overlap_and_reuse("cpu", 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloads_overlap_compute_and_blocks_come_back_on_cuda():
    overlap_and_reuse("cuda", 8192)
