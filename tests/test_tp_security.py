"""A tensor-parallel engine's channels are closed to the network and to clients without the launch's secret,
steps cross them as checked plain data (never pickles), and a rank that dies is noticed at once.

The engine tests start a second process (rank 1) over gloo on the CPU, like tests/test_tp_runtime.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from model_factory import make_checkpoint
from test_scheduler import Sim

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import EngineError
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.core.block_table import BlockTable, new_stamp
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.distributed import step_codec
from kiln.runtime.distributed.channel import MAX_FRAME_BYTES, PipeReceiver, PipeSender
from kiln.runtime.distributed.launch import RankLaunch, local_launch
from kiln.runtime.distributed.step_codec import (
    LEDGER_STEPS,
    StepCodecError,
    StepDecoder,
    StepEncoder,
    decode_start,
    encode_start,
)
from kiln.runtime.distributed.store import SECRET_VARIABLE, host_store, launch_secret, open_store
from kiln.runtime.sampling.prompt_logprobs import PromptLogprobTarget
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.engine_loader import RuntimeConfig
from kiln.runtime.worker.model_step import StepInput, TokenFeed

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9, 3], [100, 200]]
TIMEOUT = datetime.timedelta(seconds=20)


def outside_address() -> tuple[str, str] | None:
    """(interface, IPv4 address) of an interface of this machine other than loopback, or None."""
    psutil = pytest.importorskip("psutil")
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    return None


def listening(pid: int) -> set[tuple[str, int]]:
    psutil = pytest.importorskip("psutil")
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def refused_from(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-security")
    checkpoint, _ = make_checkpoint(tmp / "ckpt", "LlamaForCausalLM")
    return build_engine(checkpoint, tmp / "tp2", BuildConfig(tp_size=2), progress=False)


# ---- the step codec ------------------------------------------------------------------------------------
def scheduler_steps() -> list[StepInput]:
    """Real scheduler outputs: chunked prefill (16-token budget), prefix sharing, preemption (few blocks),
    requests joining and leaving; some with prompt-logprob targets."""
    sim = Sim(num_blocks=14, block_size=4, max_batch_size=4, max_num_tokens=16)
    shared = list(range(30, 42))
    for i in range(6):
        sim.add(f"r{i}", shared + [i, i + 1] if i % 2 else list(range(i, i + 3 + 5 * i)), max_tokens=6 + 3 * i)
    steps = []
    while sim.sched.has_unfinished():
        out = sim.step()
        targets = {r.request_id: PromptLogprobTarget(list(range(r.num_prompt_tokens)), top_k=i % 3,
                                                     logprobs=i % 4 != 2, logits=i % 4 == 2)
                   for i, r in enumerate(out.requests) if i % 2 == 0}
        steps.append(StepInput(out, targets))
    assert sim.num_preemptions > 0 and any(s.schedule.preempted_ids for s in steps)
    return steps


def stamps(step: StepInput) -> list[int]:
    return [getattr(r.block_ids, "stamp", 0) for r in step.schedule.requests]


def test_codec_round_trips_real_scheduler_outputs():
    encoder, decoder = StepEncoder(), StepDecoder()
    here, there = BlockTableMirror(), BlockTableMirror()
    sent_blocks = total_blocks = 0
    for step in scheduler_steps():
        data = encoder.encode(step)
        got = decoder.decode(data)
        assert got == step and stamps(got) == stamps(step)
        tables = [r.block_ids for r in step.schedule.requests]
        if tables:  # a rank's runner, keeping its mirror by stamp, sees the same block tables as rank 0's
            assert np.array_equal(there.gather([r.block_ids for r in got.schedule.requests]), here.gather(tables))
        sent_blocks += len(json.loads(data)["blocks"])
        total_blocks += sum(map(len, tables))
    assert decoder.decode(encoder.encode(None)) is None
    assert sent_blocks < total_blocks / 2  # tables travel as what they gained


def test_codec_sends_a_forgotten_table_whole():
    """A table sits out LEDGER_STEPS - 1 steps: the ranks still hold it. LEDGER_STEPS: sent whole again."""
    encoder, decoder = StepEncoder(), StepDecoder()
    blocks = [7, 8]
    table_stamp = new_stamp()
    idle = StepInput(SchedulerOutput((), ()))
    for steps_between, held in [(0, False), (0, True), (LEDGER_STEPS - 1, True), (LEDGER_STEPS, False), (0, True)]:
        for _ in range(steps_between):
            assert decoder.decode(encoder.encode(idle)) == idle
        had = len(blocks)
        blocks.append(had + 7)
        request = ScheduledRequest("a", (3,), 4 * had, BlockTable(blocks, len(blocks), table_stamp), 2, 1)
        step = StepInput(SchedulerOutput((request,), ()))
        data = encoder.encode(step)
        assert json.loads(data)["have"] == [had if held else 0]
        assert decoder.decode(data) == step


def valid_message() -> dict:
    step = StepInput(SchedulerOutput((ScheduledRequest("a", (1, 2, 3), 0, BlockTable([4], 1, new_stamp()), 3, 1),
                                      ScheduledRequest("b", (9,), 7, (5, 6), 5, 1, rope_min_length=8)), ("c",),
                                     ((6, 8),)),
                     {"a": PromptLogprobTarget([1, 2, 3], 2)})
    assert StepDecoder().decode(StepEncoder().encode(step)) == step  # the block copies (beam search) travel too
    return json.loads(StepEncoder().encode(step))


def mutated(**changes) -> bytes:
    message = valid_message()
    for key, value in changes.items():
        if value is KeyError:
            del message[key]
        else:
            message[key] = value
    return json.dumps(message).encode()


@pytest.mark.parametrize("data, error", [
    (b"\x80\x04\x95", "not JSON"),
    (pickle.dumps(StepInput(SchedulerOutput((), ()))), "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"kind": "step", "v": 99}', "message format 99"),
    (b'{"kind": "exec", "v": 1}', "unknown message kind 'exec'"),
    (b'{"kind": "stop", "v": 1, "x": 0}', r"unexpected field\(s\) \['x'\]"),
    (mutated(evil="os.system"), r"unexpected field\(s\) \['evil'\]"),
    (mutated(tokens=KeyError), r"missing field\(s\) \['tokens'\]"),
    (mutated(tokens=[1.5, 2, 3, 9]), r"'tokens'\[0\] must be an integer, got float"),
    (mutated(tokens=[1, True, 3, 9]), r"'tokens'\[1\] must be an integer, got bool"),
    (mutated(tokens=[1, 2, "3", 9]), r"'tokens'\[2\] must be an integer, got str"),
    (mutated(tokens=[1, 2, 3, -1]), r"'tokens'\[3\]=-1 is out of range"),
    (mutated(tokens=[1, 2, 3, 2 ** 31]), r"'tokens'\[3\]=2147483648 is out of range"),
    (mutated(tokens=[1, 2, 3]), "'tokens' has 3 entries, expected 4"),
    (mutated(tokens="1,2,3,9"), "'tokens' must be a list of integers, got str"),
    (mutated(blocks=[[4], 5, 6]), r"'blocks'\[0\] must be an integer, got list"),
    (mutated(ntok=[3]), "'ntok' has 1 entries, expected 2"),
    (mutated(ids=["a", 7]), "'ids' must be a list of strings"),
    (mutated(ids=["a", "a"]), "appears twice"),
    (mutated(nsampled=[4, 1]), r"'nsampled'\[0\]=4 exceeds the request's 3 tokens"),
    (mutated(have=[2, 0]), r"'have'\[0\]=2 exceeds the table's 1 blocks"),
    (mutated(have=[1, 0], blocks=[5, 6]), "ledgers disagree"),
    (mutated(preempted=[None]), "'preempted' must be a list of strings"),
    (mutated(copies=[3, 4, 5]), "'copies' has 3 entries: .* an even number"),
    (mutated(copies=[3, -4]), r"'copies'\[1\]=-4 is out of range"),
    (mutated(targets=[["a", [1, 2, 3], -1, True, False]]), r"'targets'\[0\]\[2\] \(top_k\)=-1 is out of range"),
    (mutated(targets=[["a", [1, 2, 3], 0, "x"]]),
     r"'targets'\[0\] must be \[request id, prompt token ids, top_k, logprobs, logits\]"),
    (mutated(targets=[["a", [1, 2.0], 0, True, False]]), r"'targets'\[0\]\[1\]\[1\] must be an integer"),
    (mutated(targets=[["a", [1, 2], 0, 1, False]]), r"'targets'\[0\]\[3:5\] \(logprobs, logits\) must be true"),
    (mutated(targets={"a": [1]}), "'targets' must be a list"),
])
def test_codec_rejects_anything_off_schema(data, error):
    with pytest.raises(StepCodecError, match=error):
        StepDecoder().decode(data)


def test_codec_refuses_a_token_feed():
    feed = TokenFeed(torch.zeros(1, dtype=torch.int64), (0,))
    with pytest.raises(StepCodecError, match="TokenFeed cannot be sent"):
        StepEncoder().encode(StepInput(SchedulerOutput((), ()), token_feed=feed))


def test_codec_covers_every_field():
    """A field added to a message's dataclasses must get a wire form here, or it would silently stay on rank 0."""
    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (ScheduledRequest, SchedulerOutput, StepInput,
                                                                       PromptLogprobTarget, RuntimeConfig, RankLaunch)}
    assert names[ScheduledRequest] == {"request_id", "token_ids", "start_position", "block_ids", "num_prompt_tokens",
                                       "num_sampled", "lora_int_id", "rope_min_length",
                                       "draft_parents"}  # refused by the encoder (tree drafts: one rank)
    assert names[SchedulerOutput] == {"requests", "preempted_ids", "block_copies", "kv_transfers"}
    assert names[StepInput] == {"schedule", "prompt_logprob_targets", "token_feed"}
    assert names[PromptLogprobTarget] == {"token_ids", "top_k", "logprobs", "logits"}
    assert names[RuntimeConfig] == set(step_codec._RUNTIME_FIELDS)
    assert names[RankLaunch] == set(step_codec._LAUNCH_FIELDS)


RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.bfloat16, max_batch_size=8, max_num_tokens=64,
                        max_seq_len=256, block_size=16, num_kv_blocks=None, enable_prefix_caching=True,
                        kv_cache_memory_fraction=0.5, cuda_graphs=False, kv_cache_dtype=torch.float8_e4m3fn,
                        async_scheduling=None)
LAUNCH = RankLaunch(1, 2, "127.0.0.1", 29500, 1, 2, external=False)


def test_start_message_round_trips():
    data = encode_start(Path("/engines/x"), RUNTIME, LAUNCH, [(0.5, 2.0)], 20)
    assert decode_start(data) == ("/engines/x", RUNTIME, LAUNCH, [(0.5, 2.0)], 20)
    assert decode_start(encode_start("e", dataclasses.replace(RUNTIME, device=torch.device("cuda", 1)), LAUNCH,
                                     None, 10))[1].device == torch.device("cuda", 1)


@pytest.mark.parametrize("path, value, error", [
    (("runtime", "dtype"), "system", r"'runtime.dtype' must name a torch dtype"),
    (("runtime", "device"), "meta", r"'runtime.device' must be 'cpu' or 'cuda\[:N\]'"),
    (("runtime", "max_batch_size"), "8", r"'runtime.max_batch_size' must be an integer"),
    (("runtime", "cuda_graphs"), 1, r"'runtime.cuda_graphs' must be true or false"),
    (("runtime", "extra"), 1, r"unexpected field\(s\) \['extra'\]"),
    (("launch", "master_addr"), None, r"'launch.master_addr' must be a string"),
    (("kv_cache_scales",), [[1.0]], "list of \\[k, v\\] pairs"),
    (("log_level",), "DEBUG", "'log_level' must be an integer"),
    (("kind",), "step", "expected the worker's start message first"),
])
def test_start_message_rejects_anything_off_schema(path, value, error):
    message = json.loads(encode_start("e", RUNTIME, LAUNCH, [(0.5, 2.0)], 20))
    target = message
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(StepCodecError, match=error):
        decode_start(json.dumps(message).encode())
    with pytest.raises(StepCodecError, match="finite number"):
        decode_start(encode_start("e", RUNTIME, LAUNCH, [(0.5, 2.0)], 20).replace(b"0.5", b"NaN"))


def test_step_pipe_carries_bytes_and_refuses_a_huge_frame():
    out = io.BytesIO()
    PipeSender([out]).send(b'{"kind":"stop","v":1}')
    assert PipeReceiver(io.BytesIO(out.getvalue())).receive() == b'{"kind":"stop","v":1}'
    with pytest.raises(ConnectionError, match="frame of"):
        PipeReceiver(io.BytesIO((MAX_FRAME_BYTES + 1).to_bytes(8, "little"))).receive()


# ---- the store and the secret ----------------------------------------------------------------------------
def test_store_listens_on_loopback_only():
    outside = outside_address()
    port = local_launch(2).master_port
    store = host_store("127.0.0.1", port, 2, TIMEOUT)
    store.set("k", "v")
    assert {address for address, p in listening(os.getpid()) if p == port} == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    assert client.get("k") == b"v"
    if outside is not None:
        assert refused_from(outside[1], port)


def run_ranks(secrets: tuple[str, str], timeouts: tuple[datetime.timedelta, ...] = (TIMEOUT, TIMEOUT)) -> list[object]:
    """Ranks 0 and 1 of a local launch entering the store with these secrets, in threads: each one's
    Admission or exception."""
    port = local_launch(2).master_port
    results: list[object] = [None, None]

    def rank(r: int) -> None:
        try:
            results[r] = open_store(RankLaunch(r, 2, "127.0.0.1", port, r, 2, external=False), secrets[r],
                                    timeouts[r])
        except Exception as e:  # handed to the test
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_ranks_with_the_secret_share_a_prefix_that_a_client_without_it_cannot_name():
    zero, one = run_ranks(("s3cret", "s3cret"))
    zero.store.set("kiln/error/rank1", "hello")
    assert one.store.get("kiln/error/rank1") == b"hello" and zero.step_key == one.step_key
    raw = dist.TCPStore("127.0.0.1", zero.store.underlying_store.port, 2, is_master=False, timeout=TIMEOUT)
    assert not raw.check(["kiln/error/rank1"])  # the engine's keys are not where a client without the secret looks
    raw.set("kiln/error/rank0", "forged")  # nor can it write where the ranks read
    assert not zero.store.check(["kiln/error/rank0"])
    again, _ = run_ranks(("s3cret", "s3cret"))
    assert again.step_key != zero.step_key  # each launch's keys are fresh (a new nonce)


def test_a_rank_with_another_secret_is_refused():
    zero, one = run_ranks(("right", "wrong"), (TIMEOUT, datetime.timedelta(seconds=2)))
    assert isinstance(zero, EngineError)
    assert f"rank 1 did not prove that it knows this launch's {SECRET_VARIABLE}" in str(zero)
    assert isinstance(one, Exception)  # rank 0 never admitted it


def test_a_rank0_without_the_secret_is_refused():
    """An impostor hosting the store cannot make a rank take it for rank 0."""
    port = local_launch(2).master_port
    store = host_store("127.0.0.1", port, 2, TIMEOUT)
    hello = "kiln-tp/0.local/hello/"
    store.set(hello + "nonce", "0" * 32)
    store.set(hello + "rank0", "f" * 64)
    with pytest.raises(EngineError, match=f"rank 0 at 127.0.0.1:{port} did not prove .*{SECRET_VARIABLE}"):
        open_store(RankLaunch(1, 2, "127.0.0.1", port, 1, 2, external=False), "right", TIMEOUT)


def test_a_launch_across_machines_needs_the_secret():
    across = RankLaunch(0, 2, "10.1.2.3", 29500, 0, 1, external=True)
    with pytest.raises(EngineError, match=f"set {SECRET_VARIABLE} to the same random string on every rank"):
        launch_secret(across, {})
    assert launch_secret(across, {SECRET_VARIABLE: "x"}) == "x"
    # every rank on this machine, meeting on loopback (torchrun --standalone): allowed without
    assert launch_secret(RankLaunch(0, 2, "127.0.0.1", 29500, 0, 2, external=True), {}) == ""
    with pytest.raises(EngineError, match=f"{SECRET_VARIABLE} is not set: rank 0 sets it"):
        launch_secret(RankLaunch(1, 2, "127.0.0.1", 29500, 1, 2, external=False), {})


def test_engine_across_machines_without_the_secret_is_refused_before_starting(tp2, monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="10.1.2.3", MASTER_PORT="29999", LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    start = time.monotonic()
    with pytest.raises(EngineError, match=SECRET_VARIABLE):
        LLM(tp2)
    assert time.monotonic() - start < 10  # refused, not waiting for 10.1.2.3


# ---- a running engine ------------------------------------------------------------------------------------
def test_engine_listens_on_loopback_only_and_ignores_forged_keys(tp2, monkeypatch):
    """Even where gloo would listen elsewhere (GLOO_SOCKET_IFNAME names another interface, as a host name that
    resolves to the machine's address would), every socket of both ranks listens on loopback."""
    outside = outside_address()
    if outside is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", outside[0])
    before = listening(os.getpid())
    with LLM(tp2) as llm:
        executor = llm.engine.executor
        (pid,) = executor.worker_pids
        sockets = (listening(os.getpid()) - before) | listening(pid)
        assert sockets and {address for address, _ in sockets} == {"127.0.0.1"}, sockets
        if outside is not None:
            assert all(refused_from(outside[1], port) for _, port in sockets)
        raw = dist.TCPStore("127.0.0.1", executor.launch.master_port, 2, is_master=False, timeout=TIMEOUT)
        raw.set("kiln/error/rank1", "forged")
        assert executor.groups.posted_errors() == {}
        (out,) = llm.generate([PROMPTS[0]], GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens and executor.fault is None
    if outside is not None:
        assert os.environ["GLOO_SOCKET_IFNAME"] == outside[0]  # rank 0's process gets its variables back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_engine_listens_on_loopback_only(tmp_path):
    """NCCL's bootstrap sockets too (it picks a non-loopback interface unless NCCL_SOCKET_IFNAME says)."""
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(device="cuda", tp_size=2, max_batch_size=8,
                                                                    max_num_tokens=64, max_seq_len=256),
                          progress=False)
    before, variable = listening(os.getpid()), os.environ.get("NCCL_SOCKET_IFNAME")
    with LLM(engine) as llm:
        (pid,) = llm.engine.executor.worker_pids
        sockets = (listening(os.getpid()) - before) | listening(pid)
        assert sockets and {address for address, _ in sockets} <= {"127.0.0.1", "::1"}, sockets
        (out,) = llm.generate([PROMPTS[0]], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens
    assert os.environ.get("NCCL_SOCKET_IFNAME") == variable  # rank 0's process gets its variables back


@pytest.mark.parametrize("when", ["between steps", "during a step"])
def test_killed_rank_is_a_fault_within_2s_and_shutdown_does_not_wait(tp2, when):
    llm = LLM(tp2)
    executor = llm.engine.executor
    try:
        (pid,) = executor.worker_pids
        if when == "between steps":
            llm.generate([PROMPTS[0]], GREEDY)
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            while executor.fault is None and time.monotonic() - start < 5:
                time.sleep(0.01)
            assert time.monotonic() - start < 2
            with pytest.raises(EngineError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
                llm.generate([PROMPTS[1]], GREEDY)
        else:
            stream = llm.stream([list(range(10, 20))], SamplingParams(max_tokens=200, temperature=0.0,
                                                                      ignore_eos=True))
            next(stream)
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
                for _ in stream:
                    pass
            assert time.monotonic() - start < 2
        assert executor.fault is not None and "rank 1" in executor.fault
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 2


# ---- a launch across machines (two processes meeting on this machine's outside address) -------------------
def launch_across(engine: Path, tmp_path: Path, secrets: tuple[str, str]) -> list[subprocess.CompletedProcess]:
    outside = outside_address()
    if outside is None:
        pytest.skip("no interface besides loopback")
    script = tmp_path / "rank.py"
    script.write_text("import json\n"
                      "from kiln.runtime import LLM, SamplingParams\n"
                      f"llm = LLM({str(engine)!r})\n"
                      f"outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=8, temperature=0.0, "
                      "ignore_eos=True))\n"
                      "print('TOKENS', json.dumps([o.token_ids for o in outs]), flush=True)\n"
                      "llm.shutdown()\n")
    port = local_launch(2).master_port
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": outside[1],
               "MASTER_PORT": str(port), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
               SECRET_VARIABLE: secrets[rank]}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:  # rank 1 ends with rank 0 (its store goes), or is killed
        try:
            stdout, stderr = p.communicate(timeout=180 if not results else 20)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


@pytest.mark.slow
def test_launch_across_machines_with_the_secret_runs_steps_over_gloo(tp2, tmp_path):
    zero, one = launch_across(tp2, tmp_path, ("shared", "shared"))
    assert zero.returncode == 0 and one.returncode == 0, zero.stderr[-3000:] + one.stderr[-3000:]
    with LLM(tp2) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    (line,) = [x for x in zero.stdout.splitlines() if x.startswith("TOKENS")]
    assert json.loads(line.removeprefix("TOKENS ")) == expected


@pytest.mark.slow
def test_launch_across_machines_with_another_secret_is_refused(tp2, tmp_path):
    zero, _ = launch_across(tp2, tmp_path, ("shared", "other"))
    assert zero.returncode != 0
    assert f"rank 1 did not prove that it knows this launch's {SECRET_VARIABLE}" in zero.stderr
