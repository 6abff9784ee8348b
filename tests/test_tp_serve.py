"""`kiln serve` on a tensor-parallel engine (two CPU processes over gloo): it serves rank 0's tokens, SIGTERM
stops every rank, and a rank that dies turns health unready and ends the server with the cause."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from model_factory import make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

PROMPT = [5, 17, 42, 9, 3, 88]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-serve")
    checkpoint, _ = make_checkpoint(tmp / "ckpt", "LlamaForCausalLM")
    return tuple(build_engine(checkpoint, tmp / f"tp{tp}", BuildConfig(tp_size=tp), progress=False) for tp in (1, 2))


def _serve(engine: Path) -> tuple[subprocess.Popen, int, int]:
    """A `kiln serve` process, once ready: (process, HTTP port, the pid of its rank 1)."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", "--engine", str(engine), "--model-name", "m", "--http-port", "0",
                             "--grpc-port", "0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if match := re.search(r"ready on http://127\.0\.0\.1:(\d+)", line):
                break
            if not line and proc.poll() is not None:
                raise AssertionError("".join(seen))
        else:
            raise AssertionError("".join(seen))
        # The engine starts in a thread, whose task lists the child.
        children = [pid for task in Path(f"/proc/{proc.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        (worker,) = [int(pid) for pid in children]
    except BaseException:
        proc.kill()  # its rank 1 notices that rank 0 is gone and exits
        raise
    return proc, int(match.group(1)), worker


def _complete(port: int) -> str:
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        choice = json.load(response)["choices"][0]
    return choice["text"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_serve_tp_engine_then_sigterm_stops_every_rank(engines):
    tp1, tp2 = engines
    with LLM(tp1) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    proc, port, worker = _serve(tp2)
    try:
        assert _complete(port) == expected.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dead_rank_makes_serve_unready_then_exit_naming_it(engines):
    _, tp2 = engines
    proc, port, worker = _serve(tp2)
    try:
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        unready = False
        while proc.poll() is None and time.monotonic() - start < 30:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)
            except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError):
                unready = True
            time.sleep(0.1)
        assert proc.wait(30) == 1
        assert time.monotonic() - start < 30
        output = proc.stdout.read()
        assert unready
        assert re.search(r"the engine failed \(.*rank 1 \(pid \d+\) was killed by SIGKILL", output), output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ranks_end_when_rank_0_is_killed(engines):
    """SIGKILL leaves rank 0 no time to stop anyone: its ranks notice (closed step pipe, store gone) and exit."""
    _, tp2 = engines
    proc, _, worker = _serve(tp2)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _stream_openai(port: int, results: dict, key: str) -> None:
    """An OpenAI completions stream long enough to be cut off: records the events it read and how it ended."""
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    events = []
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            for line in response:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip().decode())
        results[key] = ("events", events)
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        results[key] = ("raised", f"{type(e).__name__}: {e}", events)


def _triton_generate(port: int, results: dict, key: str) -> None:
    body = json.dumps({"text_input": "hello world", "max_tokens": 200, "parameters": {"ignore_eos": True}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/m/generate", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            results[key] = ("status", response.status, response.read().decode())
    except urllib.error.HTTPError as e:
        results[key] = ("status", e.code, e.read().decode())
    except Exception as e:  # noqa: BLE001
        results[key] = ("raised", f"{type(e).__name__}: {e}")


def test_dead_rank_fails_every_request_at_once_and_exits_promptly(engines):
    """kill -9 of rank 1 with requests in flight: each Triton /generate client gets a 503 naming the cause (not
    aiohttp's bare 500), each OpenAI stream ends with an error event and [DONE], and the process exits within
    seconds, not after --shutdown-timeout."""
    import threading

    _, tp2 = engines
    proc, port, worker = _serve(tp2)
    results: dict = {}
    try:
        threads = [threading.Thread(target=_stream_openai, args=(port, results, f"openai-{i}")) for i in range(4)]
        threads += [threading.Thread(target=_triton_generate, args=(port, results, f"triton-{i}")) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every request admitted and running
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        answered = time.monotonic() - killed
        assert proc.wait(30) == 1
        exited = time.monotonic() - killed
        output = proc.stdout.read()
        assert "Server got itself in trouble" not in output
        for key, result in results.items():
            if key.startswith("triton"):
                # Finished before the kill (a fast CPU) or refused with the cause: never a bare 500.
                assert result[0] == "status" and result[1] in (200, 503), (key, result)
                if result[1] == 503:
                    assert "rank 1" in result[2] and "engine has stopped" in result[2], result
            else:
                assert result[0] == "events", (key, result)
                events = result[1]
                assert events and events[-1] == "[DONE]", (key, events[-3:])
                if '"error"' in events[-2]:
                    assert "engine has stopped" in events[-2], events[-2]
        assert len(results) == 8
        print(f"kill -9 of rank 1: every client answered after {answered:.2f} s, the server exited after "
              f"{exited:.2f} s; answers: {sorted(str(r[1]) if r[0] == 'status' else r[1][-1] for r in results.values())}")
        assert answered < 5, answered
        assert exited < 8, exited
    finally:
        if proc.poll() is None:
            proc.kill()
