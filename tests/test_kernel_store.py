"""Compiled kernels stored in an engine (kernels/triton/): collected from a Triton cache at build, installed into
Triton's cache at load, refused when tampered with, left out with one warning on another GPU or toolchain.

CPU tests use Triton's own cache manager to write and read fake entries (what a compile would write); the GPU
tests at the end build a real engine and count Triton's compilations in a fresh process."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_factory import make_checkpoint

from kiln.builder import kernel_store as builder_store
from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import ENGINE_JSON, EngineError, FileEntry, load_engine_spec, write_engine_json
from kiln.engine_format.kernels import KERNELS_DIR, KernelTarget, Toolchain
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.worker import kernel_store as runtime_store

pytest.importorskip("triton", reason="the stored kernels are Triton's")

TOOLCHAIN = Toolchain(gpu_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), triton_version="3.6.0",
                      torch_version="2.11.0+cu130", cuda_version="13.0", kiln_version="0.1.0")
CUDA = torch.device("cuda", 0)
_SO = ".cpython-312-x86_64-linux-gnu.so"


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch, tmp_path):
    """Each test: no earlier install remembered, Triton's cache a new empty folder (and Triton's cache settings
    as they were afterwards: a fallback points them elsewhere)."""
    from triton import knobs

    monkeypatch.setattr(runtime_store, "_done", {})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    with knobs.cache.scope():
        yield


@pytest.fixture
def fake_machine(monkeypatch):
    """This machine's GPU and toolchain are `TOOLCHAIN`, at build and at load."""
    monkeypatch.setattr(runtime_store, "current_toolchain", lambda device: TOOLCHAIN)
    monkeypatch.setattr(builder_store, "current_toolchain", lambda device: TOOLCHAIN)
    monkeypatch.setattr(builder_store.torch.cuda, "current_device", lambda: 0)


def fake_compile(cache: Path) -> None:
    """What compiling two kernels and their launcher writes into a Triton cache, through Triton's own cache
    manager: each kernel's IRs, binary, metadata and group (absolute paths), a launcher module, a lock file."""
    from triton.runtime.cache import FileCacheManager

    os.environ["TRITON_CACHE_DIR"] = str(cache)
    for key, name in (("AAAA", "_rms_norm_kernel"), ("BBBB", "_decode_kernel")):
        manager = FileCacheManager(key)
        group = {f"{name}.{ext}": manager.put(f"{ext} of {name}", f"{name}.{ext}") for ext in ("ttir", "ptx", "llir")}
        group[f"{name}.cubin"] = manager.put(f"binary of {name}".encode(), f"{name}.cubin")
        group[f"{name}.json"] = manager.put(json.dumps({"name": name}), f"{name}.json")
        manager.put_group(f"{name}.json", group)
    FileCacheManager("CCCC").put(b"\x7fELF launcher", "__triton_launcher" + _SO)
    (cache / "CCCC" / "lock").touch()
    (cache / "tmp.pid_1_x").mkdir()


def cpu_engine(tmp_path: Path) -> Path:
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    limits = dict(max_batch_size=4, max_num_tokens=32, max_seq_len=64, kv_block_size=4)
    return build_engine(checkpoint, tmp_path / "engine", BuildConfig(**limits), progress=False)


def engine_fields(engine: Path) -> dict:
    """engine.json as `write_engine_json`'s keywords."""
    document = json.loads((engine / ENGINE_JSON).read_text())
    document["files"] = {path: FileEntry(**entry) for path, entry in document["files"].items()}
    return document


@pytest.fixture
def kernel_engine(tmp_path, monkeypatch, fake_machine):
    """A tiny engine with two fake compiled kernels and a launcher stored the way `kiln build --device cuda`
    stores them (the child process's compile replaced by `fake_compile`)."""
    engine = cpu_engine(tmp_path)
    monkeypatch.setattr(builder_store, "run_warmup", lambda engine_dir, cache, index: fake_compile(cache))
    write_engine_json(engine, **builder_store.with_stored_kernels(engine, engine_fields(engine)))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # fake_compile pointed it elsewhere
    return engine


def test_build_stores_binaries_and_metadata_with_relative_groups(kernel_engine):
    spec = load_engine_spec(kernel_engine)
    stored = sorted(p for p in spec.files if p.startswith(KERNELS_DIR))
    assert stored == [f"{KERNELS_DIR}/AAAA/__grp___rms_norm_kernel.json", f"{KERNELS_DIR}/AAAA/_rms_norm_kernel.cubin",
                      f"{KERNELS_DIR}/AAAA/_rms_norm_kernel.json", f"{KERNELS_DIR}/BBBB/__grp___decode_kernel.json",
                      f"{KERNELS_DIR}/BBBB/_decode_kernel.cubin", f"{KERNELS_DIR}/BBBB/_decode_kernel.json",
                      f"{KERNELS_DIR}/CCCC/__triton_launcher{_SO}"]  # no IRs, locks or temporary folders
    group = json.loads((kernel_engine / KERNELS_DIR / "AAAA" / "__grp___rms_norm_kernel.json").read_text())
    assert group == {"child_paths": {"_rms_norm_kernel.cubin": "_rms_norm_kernel.cubin",
                                     "_rms_norm_kernel.json": "_rms_norm_kernel.json"}}
    target = KernelTarget.from_dict(spec.target["kernels"], "target.kernels")
    assert (target.toolchain, target.num_kernels, target.num_launchers) == (TOOLCHAIN, 2, 1)
    assert target.total_bytes == sum(spec.files[p].size for p in stored)
    assert builder_store.stored_kernels_line(kernel_engine) is None  # a CPU-targeted engine: nothing to say
    fields = engine_fields(kernel_engine)
    fields["target"]["device_type"] = "cuda"
    write_engine_json(kernel_engine, **fields)
    assert builder_store.stored_kernels_line(kernel_engine) == (
        "kernels: 2 compiled kernels and 1 launchers stored (0.0 MiB) for NVIDIA H100 80GB HBM3 (sm_90), "
        "Triton 3.6.0, torch 2.11.0+cu130, CUDA 13.0, kiln 0.1.0")
    fields["target"].pop("kernels")
    write_engine_json(kernel_engine, **fields)
    assert "none stored (--no-kernels" in builder_store.stored_kernels_line(kernel_engine)


def test_install_makes_triton_find_every_kernel_and_launcher(kernel_engine, tmp_path):
    from triton.runtime.cache import FileCacheManager

    result = runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), CUDA)
    cache = tmp_path / "triton-cache"
    assert (result.status, result.num_files, result.num_present, result.cache_dir) == ("installed", 7, 0, str(cache))
    group = FileCacheManager("AAAA").get_group("_rms_norm_kernel.json")  # what Triton's compile() looks up
    assert group == {"_rms_norm_kernel.cubin": str(cache / "AAAA" / "_rms_norm_kernel.cubin"),
                     "_rms_norm_kernel.json": str(cache / "AAAA" / "_rms_norm_kernel.json")}
    assert Path(group["_rms_norm_kernel.cubin"]).read_bytes() == b"binary of _rms_norm_kernel"
    assert FileCacheManager("CCCC").get_file("__triton_launcher" + _SO) is not None
    # Once per engine in a process; another process (here: the memory cleared) finds them cached.
    assert runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), CUDA) is result
    runtime_store._done.clear()
    again = runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), CUDA)
    assert (again.num_files, again.num_present) == (0, 7)
    assert not list(kernel_engine.glob("**/*.tmp"))  # the engine directory is never written


def test_another_gpu_or_toolchain_leaves_them_out_with_one_warning(kernel_engine, tmp_path, monkeypatch, caplog):
    here = dataclasses.replace(TOOLCHAIN, gpu_name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0))
    monkeypatch.setattr(runtime_store, "current_toolchain", lambda device: here)
    spec = load_engine_spec(kernel_engine)
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        assert runtime_store.install_engine_kernels(spec, CUDA).status == "mismatch"
        assert runtime_store.install_engine_kernels(spec, CUDA).status == "mismatch"
    [warning] = [r.getMessage() for r in caplog.records]
    assert "NVIDIA H100 80GB HBM3 (sm_90)" in warning and "NVIDIA A100-SXM4-80GB (sm_80)" in warning
    assert "compute_capability (9, 0) -> (8, 0)" in warning and "compiles" in warning
    assert not (tmp_path / "triton-cache").exists()
    monkeypatch.setattr(runtime_store, "current_toolchain", lambda device: dataclasses.replace(
        TOOLCHAIN, triton_version="3.7.0"))
    runtime_store._done.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        assert runtime_store.install_engine_kernels(spec, CUDA).status == "mismatch"
    assert "triton_version 3.6.0 -> 3.7.0" in caplog.records[-1].getMessage()


def test_a_tampered_kernel_is_refused_by_its_hash(kernel_engine):
    cubin = kernel_engine / KERNELS_DIR / "BBBB" / "_decode_kernel.cubin"
    cubin.write_bytes(cubin.read_bytes().replace(b"binary", b"BINARY"))  # same size: only the hash tells
    with pytest.raises(EngineError, match=f"{KERNELS_DIR}/BBBB/_decode_kernel.cubin has sha256 that differs"):
        load_engine_spec(kernel_engine)
    with pytest.raises(EngineError, match="_decode_kernel.cubin has sha256 that differs .* never loaded unchecked"):
        runtime_store.install_engine_kernels(load_engine_spec(kernel_engine, verify_checksums=False), CUDA)


def test_a_cache_that_cannot_be_written_falls_back_to_a_private_one(kernel_engine, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # root ignores permission bits: a file where the folder should be blocks it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocked))
    result = runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), CUDA)
    assert result.status == "installed" and result.cache_dir != str(blocked)
    assert os.environ["TRITON_CACHE_DIR"] == result.cache_dir
    assert (Path(result.cache_dir) / "AAAA" / "_rms_norm_kernel.cubin").is_file()


def test_cpu_devices_and_engines_without_kernels_install_nothing(kernel_engine, tmp_path):
    assert runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), torch.device("cpu")).status == "none"
    plain = load_engine_spec(kernel_engine)
    plain.target.pop("kernels")
    assert runtime_store.install_engine_kernels(plain, CUDA).status == "none"
    assert not (tmp_path / "triton-cache").exists()


@pytest.mark.parametrize("change, message", [
    (lambda k: k.update(triton_version=3), r"target.kernels.triton_version is 3: expected str"),
    (lambda k: k.update(compute_capability=[9]), r"target.kernels.compute_capability is \[9\]"),
    (lambda k: k.update(format="tar"), r"format 'tar' .* is not one this kiln reads"),
    (lambda k: k.pop("num_kernels"), r"target.kernels.num_kernels is None: expected int"),
])
def test_a_bad_kernels_record_names_its_field(kernel_engine, change, message):
    fields = engine_fields(kernel_engine)
    change(fields["target"]["kernels"])
    write_engine_json(kernel_engine, **fields)
    with pytest.raises(EngineError, match=message + ".*rebuild the engine"):
        runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), CUDA)


def test_a_kernel_path_outside_the_layout_is_refused(kernel_engine):
    fields = engine_fields(kernel_engine)
    odd = f"{KERNELS_DIR}/AAAA/sub/x.cubin"
    (kernel_engine / odd).parent.mkdir()
    (kernel_engine / odd).write_bytes(b"x")
    fields["files"][odd] = builder_store.file_entry(kernel_engine / odd)
    write_engine_json(kernel_engine, **fields)
    with pytest.raises(EngineError, match="must be kernels/triton/<entry>/<file>"):
        runtime_store.install_engine_kernels(load_engine_spec(kernel_engine), CUDA)


def test_tensor_parallel_engines_store_none_yet(tmp_path, caplog):
    fields = {"mapping": {"tp_size": 2, "num_ranks": 2}, "files": {}, "target": {}}
    with caplog.at_level(logging.WARNING, logger="kiln.builder"):
        assert builder_store.with_stored_kernels(tmp_path, fields) is fields
    assert "no kernels stored: kernels are not stored for tensor-parallel engines yet" in caplog.text


def test_kernels_need_a_cuda_build_and_the_cli_turns_them_on_for_cuda_only():
    with pytest.raises(ValueError, match="kernels=True stores compiled GPU kernels: it needs device='cuda'"):
        BuildConfig(kernels=True)
    assert BuildConfig(device="cuda", kernels=True).kernels
    from kiln.cli import make_parser

    args = make_parser().parse_args(["build", "--checkpoint", "c", "--output", "o", "--device", "cuda",
                                      "--no-kernels"])
    assert args.no_kernels


def test_a_failing_warmup_names_no_kernels(tmp_path, monkeypatch):
    def failed(command, **kwargs):
        assert command[1:3] == ["-m", "kiln.runtime.engine.kernel_warmup"] and kwargs["env"]["TRITON_CACHE_DIR"] == "c"
        return subprocess.CompletedProcess(command, 1, stdout="Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory")

    monkeypatch.setattr(builder_store.subprocess, "run", failed)
    with pytest.raises(builder_store.KernelStoreError, match="(?s)failed \\(exit 1\\).*out of memory.*--no-kernels"):
        builder_store.run_warmup(tmp_path, Path("c"), 0)


class _RecordingLLM:
    """Stands in for a started engine: checks each warm-up request against the limits, as add_request would;
    its engine's steps give every request one token."""

    def __init__(self, limits: dict, vocab: int) -> None:
        self.running: dict[str, list[int]] = {}  # request id -> [max_tokens, tokens so far]
        self.engine = SimpleNamespace(runtime=SimpleNamespace(block_size=16, **limits),
                                      model_config=SimpleNamespace(vocab_size=vocab), add_request=self.add_request,
                                      step=self.step, abort=self.running.pop, has_unfinished=lambda: bool(self.running))
        self.limits, self.vocab, self.requests = limits, vocab, []

    def add_request(self, prompt, params) -> str:
        self.generate([prompt], [params])
        request_id = f"r{len(self.requests)}"
        self.running[request_id] = [params.max_tokens, 0]
        return request_id

    def step(self, final_only=False):
        outs = []
        for request_id, progress in list(self.running.items()):
            progress[1] += 1
            done = progress[1] >= progress[0]
            if done:
                del self.running[request_id]
            if done or not final_only:
                outs.append(SimpleNamespace(request_id=request_id, token_ids=[7] * progress[1]))
        return outs

    def generate(self, prompts, params):
        assert len(prompts) == len(params)
        for prompt, p in zip(prompts, params):
            assert 1 <= len(prompt) and len(prompt) + p.max_tokens <= self.limits["max_seq_len"]
            assert all(3 <= t < self.vocab for t in prompt)
            self.requests.append((len(prompt), p))


@pytest.mark.parametrize("limits", [dict(max_batch_size=4, max_num_tokens=32, max_seq_len=64),
                                    dict(max_batch_size=1024, max_num_tokens=8192, max_seq_len=4224),
                                    dict(max_batch_size=1, max_num_tokens=16, max_seq_len=8)])
def test_warmup_workload_stays_within_the_engines_limits(limits):
    from kiln.runtime.engine.kernel_warmup import warm_up

    llm = _RecordingLLM(limits, vocab=400)
    assert warm_up(llm) == len(llm.requests)
    lengths = {n for n, _ in llm.requests}
    longest = limits["max_seq_len"] - 4
    assert {1, 2, 3, min(16, longest)} <= lengths and max(lengths) <= longest
    if limits["max_seq_len"] > 2 * limits["max_num_tokens"]:  # a prompt of several chunks
        assert max(lengths) > limits["max_num_tokens"]
    assert any(p.prompt_logprobs for _, p in llm.requests) and any(p.top_logprobs for _, p in llm.requests)
    assert {p.temperature for _, p in llm.requests} >= {0.0, 0.7, 0.8, 1.0}
    assert not llm.running


def test_mixed_steps_join_decoding_sequences_of_every_table_width(tmp_path):
    """On a real engine (CPU): sequences decode at contexts 1, 9 and 16 blocks wide while prompts join them;
    every request ends and frees its blocks."""
    from kiln.runtime.engine.kernel_warmup import mixed_steps

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(max_batch_size=4, max_num_tokens=64,
                                                                       max_seq_len=128, kv_block_size=4),
                          progress=False)
    llm = LLM(engine)
    seen: list[tuple[int, int]] = []  # (sequences, longest table) of each step
    run = llm.engine.executor.execute

    def execute(step):
        tables = [len(r.block_ids) for r in step.schedule.requests]
        seen.append((len(tables), max(tables)))
        return run(step)

    llm.engine.executor.execute = execute
    assert mixed_steps(llm, lambda n, salt: [(3 * i + salt) % 390 + 3 for i in range(n)]) == 3 * (2 + 2 * 4)
    assert {width for seqs, width in seen if seqs > 2} >= {1, 9, 16}
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_startup_log_names_every_stage(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="kiln.runtime"):
        llm = LLM(cpu_engine(tmp_path))
    ready = next(r.getMessage() for r in caplog.records if "ready in" in r.getMessage())
    for stage in ("load", "kernels 0.00s (none stored)", "weights", "profile+allocate", "graphs",
                  "verify (overlapped)"):
        assert stage in ready
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2


# -- on a GPU ----------------------------------------------------------------------------------------------

_SERVE = r"""
import json, sys
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.engine.kernel_warmup import count_compiles
with count_compiles() as compiled:
    llm = LLM(sys.argv[1])
    outs = llm.generate([[(5 * i + n) % 390 + 2 for i in range(n)] for n in (1, 9, 40, 23, 60, 3)],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
print("RESULT", json.dumps({"compiled": compiled, "tokens": [o.token_ids for o in outs]}))
"""

def _serve_fresh(engine: Path, triton_cache: Path) -> tuple[dict, set[str], str]:
    """Serves `engine` in a new process whose Triton cache starts empty: its result, the cache's files after,
    and its stderr."""
    triton_cache.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    done = subprocess.run([sys.executable, "-c", _SERVE, str(engine)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    return result, {str(p.relative_to(triton_cache)) for p in triton_cache.rglob("*") if p.is_file()}, done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stored_kernels_compile_nothing_in_a_fresh_process_and_fall_back_on_another_toolchain(tmp_path):
    """Built in this process, served in fresh ones with empty Triton caches: with the engine's kernels nothing
    is compiled (no kernel, no launcher: the cache holds only what was installed); with a toolchain that does
    not match, a warning and Triton compiles as without stored kernels; the same tokens either way."""
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    limits = dict(dtype="bfloat16", max_batch_size=8, max_num_tokens=64, max_seq_len=128, kv_block_size=16)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(device="cuda", kernels=True, **limits),
                          progress=False)
    spec = load_engine_spec(engine)
    assert spec.target["kernels"]["num_kernels"] > 5 and spec.target["kernels"]["num_launchers"] > 0
    stored, files, _ = _serve_fresh(engine, tmp_path / "cache-stored")
    assert stored["compiled"] == []
    assert files == {p.removeprefix(KERNELS_DIR + "/") for p in spec.files if p.startswith(KERNELS_DIR)}

    fields = engine_fields(engine)
    fields["target"]["kernels"]["triton_version"] = "0.0.1"
    write_engine_json(engine, **fields)
    compiled, _, stderr = _serve_fresh(engine, tmp_path / "cache-mismatch")
    assert "triton_version 0.0.1 -> " in stderr and "compiles its kernels here" in stderr
    assert len(compiled["compiled"]) > 5  # as without stored kernels: compiled at first use
    assert stored["tokens"] == compiled["tokens"]
