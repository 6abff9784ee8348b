"""`kiln serve` under abuse: a queue cap, timeouts and a connection limit, bounded bodies, Host and Origin
checks, honest truncation at shutdown, and shutdown on time. Each against a real server on loopback."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib

import pytest
from serve_util import MODEL_NAME, start_server

from kiln.commands.serve import _api_key

PROMPT = "def add(a, b):"
GENERATE = f"/v2/models/{MODEL_NAME}/generate"
# Triton requests that run long: EOS replaced by a token the model practically never produces.
LONG = {"text_input": PROMPT, "max_tokens": 900, "end_id": 7999}


def request(srv, path, body=None, headers=None, method=None, timeout=30):
    """-> (status, headers, parsed JSON or text); never raises for an HTTP error status."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.http_base + path, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, head, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, e.headers, e.read()
    try:
        return status, head, json.loads(raw)
    except ValueError:
        return status, head, raw.decode(errors="replace")


def healthy(srv) -> bool:
    return request(srv, "/v2/health/ready", timeout=5)[0] == 200


def greedy(srv) -> str:
    status, _, body = request(srv, GENERATE, {"text_input": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return body["text_output"]


def peak_rss_mib() -> float:
    """This process's (the in-process server's) peak resident memory since the last reset, in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def wait_blocks_free(srv, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = srv.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks not free: {srv.kv_cache_stats()}")


@pytest.fixture(scope="module")
def srv(tiny_code_engine):
    s = start_server(tiny_code_engine, keep_alive_timeout_s=0.5, body_timeout_s=0.5, max_connections=6,
                     allowed_origins=("http://trusted.example",))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(srv):
    return greedy(srv)


# ---- bodies ----------------------------------------------------------------------------------------------
def test_gzip_bomb_stops_at_the_limit_and_health_keeps_answering(srv, reference):
    bomb = gzip.compress(b" " * 2**28, compresslevel=9)  # 256 KB inflating to 256 MiB (the review sent 1 GiB)
    reset_peak_rss()
    before = peak_rss_mib()
    start = time.perf_counter()
    status, _, body = request(srv, GENERATE, bomb, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert status == 413 and "--max-request-bytes" in body["error"]
    assert time.perf_counter() - start < 2.0 and healthy(srv)
    assert peak_rss_mib() - before < 64  # inflation stopped at the 8 MiB limit, not at 256 MiB
    assert greedy(srv) == reference


@pytest.mark.parametrize("encoding, body, status, message", [
    ("gzip", b'{"text_input": "x", "max_tokens": 1}', 400, "not valid gzip"),
    ("br", b"\x0b\x02\x80{}\x03", 415, "Content-Encoding 'br' is not supported"),
])
def test_bad_content_encoding_is_a_4xx(srv, encoding, body, status, message):
    got, _, answer = request(srv, GENERATE, body, {"Content-Encoding": encoding})
    assert got == status and message in answer["error"]


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_bodies_work(srv, reference, encoding, compress):
    body = compress(json.dumps({"text_input": PROMPT, "max_tokens": 8, "temperature": 0}).encode())
    status, _, answer = request(srv, GENERATE, body, {"Content-Encoding": encoding})
    assert status == 200 and answer["text_output"] == reference


def test_the_reviews_7_9_mb_of_prompts_is_refused_in_bounded_memory(srv, reference):
    body = b'{"max_tokens": 1, "prompt": [' + b",".join([b"[1,2]"] * 1_300_000) + b"]}"  # 7.9 MB
    reset_peak_rss()
    before = peak_rss_mib()
    start = time.perf_counter()
    status, _, answer = request(srv, "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 413 and "JSON arrays and objects" in answer["error"]["message"]
    assert time.perf_counter() - start < 2.0 and healthy(srv)
    assert peak_rss_mib() - before < 200  # the review saw 18.9 GB
    assert greedy(srv) == reference


def test_a_body_of_millions_of_arrays_is_refused_without_parsing(srv):
    body = b'{"text_input": "x", "max_tokens": 1, "stop_words": [' + b",".join([b"[]"] * 1_000_000) + b"]}"
    start = time.perf_counter()
    status, _, answer = request(srv, GENERATE, body)
    assert status == 413 and "JSON arrays and objects" in answer["error"]
    assert time.perf_counter() - start < 2.0 and healthy(srv)


# ---- connections and time --------------------------------------------------------------------------------
def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing `sock`; fails if it is still open after `seconds`."""
    sock.settimeout(seconds)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def test_slow_request_head_and_idle_connections_are_closed(srv):
    with socket.create_connection(("127.0.0.1", srv.server.http_port)) as slow:
        slow.sendall(b"POST /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its head
        _closed_within(slow, 3.0)
    with socket.create_connection(("127.0.0.1", srv.server.http_port)) as idle:
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _closed_within(idle, 3.0).startswith(b"HTTP/1.1 200")  # answered, then closed when idle


def test_slow_body_is_a_408(srv):
    with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
        sock.sendall(b"POST " + GENERATE.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        answer = _closed_within(sock, 5.0)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer


def test_connections_over_the_limit_are_refused_and_served_again_later(srv):
    held = [socket.create_connection(("127.0.0.1", srv.server.http_port)) for _ in range(6)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", srv.server.http_port)) as extra:
            assert _closed_within(extra, 3.0).startswith(b"HTTP/1.1 503")
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert healthy(srv)


# ---- who may call ----------------------------------------------------------------------------------------
def test_foreign_host_and_cross_site_origin_are_refused(srv):
    status, _, body = request(srv, "/v2", headers={"Host": "evil.example"})
    assert status == 403 and "--allowed-hosts" in body["error"]
    status, _, body = request(srv, GENERATE, {"text_input": "x", "max_tokens": 1}, {"Origin": "http://evil.example"})
    assert status == 403 and "--allowed-origins" in body["error"]
    status, _, body = request(srv, "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 403 and body["error"]["param"] == "Origin"


def test_allowed_origin_gets_cors_headers_and_preflight(srv):
    status, head, _ = request(srv, "/v2", headers={"Origin": "http://trusted.example"})
    assert status == 200 and head["Access-Control-Allow-Origin"] == "http://trusted.example"
    status, head, _ = request(srv, GENERATE, method="OPTIONS", headers={
        "Origin": "http://trusted.example", "Access-Control-Request-Method": "POST"})
    assert status == 204 and "POST" in head["Access-Control-Allow-Methods"]


def test_non_ascii_authorization_is_a_401(tiny_code_engine):
    s = start_server(tiny_code_engine, api_key="secret")
    try:
        with socket.create_connection(("127.0.0.1", s.server.http_port)) as sock:
            sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\xe9\r\n"
                         b"Connection: close\r\n\r\n")
            assert _closed_within(sock, 5.0).startswith(b"HTTP/1.1 401")
        assert request(s, "/v2", headers={"Authorization": "Bearer secret"})[0] == 200
    finally:
        s.stop()


def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    args = argparse.Namespace(api_key=None, api_key_file=str(key_file))
    assert _api_key(args) == "from-file"
    monkeypatch.setenv("KILN_API_KEY", "from-env")
    assert _api_key(argparse.Namespace(api_key=None, api_key_file=None)) == "from-env"
    assert _api_key(argparse.Namespace(api_key="given", api_key_file=None)) == "given"
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        _api_key(args)


# ---- admission -------------------------------------------------------------------------------------------
def _long(srv, results, i):
    results[i] = request(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 250, "ignore_eos": True},
                         timeout=120)


def test_a_full_queue_is_a_429_and_admitted_requests_finish(tiny_code_engine):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: F401

    s = start_server(tiny_code_engine, max_batch_size=1, max_queued_requests=2)
    try:
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=_long, args=(s, results, i)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while s.service.num_queued < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.service.num_queued == 2
        status, head, body = request(s, GENERATE, {"text_input": PROMPT, "max_tokens": 1})
        assert status == 429 and head["Retry-After"] == "1" and "--max-queued-requests 2" in body["error"]
        status, _, body = request(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        import numpy as np

        client = grpcclient.InferenceServerClient(s.grpc_url)
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=object))
        tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        tokens.set_data_from_numpy(np.array([[1]], dtype=np.int32))
        with pytest.raises(InferenceServerException) as e:
            client.infer(MODEL_NAME, [text, tokens])
        assert "RESOURCE_EXHAUSTED" in str(e.value.status()) and "--max-queued-requests" in e.value.message()
        for t in threads:
            t.join(120)
        assert all(results[i][0] == 200 for i in range(3))  # admitted requests are never dropped
        metrics = urllib.request.urlopen(s.metrics_url, timeout=10).read().decode()
        assert 'kiln_requests_total{outcome="overloaded"} 3.0' in metrics
        wait_blocks_free(s)
    finally:
        s.stop()


# ---- shutdown --------------------------------------------------------------------------------------------
def test_requests_cut_off_by_shutdown_say_so(tiny_code_engine):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    s = start_server(tiny_code_engine, shutdown_timeout_s=0.0)
    results: dict[str, object] = {}

    def generate():
        results["generate"] = request(s, GENERATE, LONG, timeout=120)

    def stream():
        results["stream"] = request(s, GENERATE + "_stream", LONG, timeout=120)

    def infer():
        client = grpcclient.InferenceServerClient(s.grpc_url)
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=object))
        tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        tokens.set_data_from_numpy(np.array([[900]], dtype=np.int32))
        try:
            client.infer(MODEL_NAME, [text, tokens], client_timeout=120)
            results["grpc"] = "ok"
        except InferenceServerException as e:
            results["grpc"] = e

    threads = [threading.Thread(target=f) for f in (generate, stream, infer)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while s.kv_cache_stats()["num_running"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.stop()
    for t in threads:
        t.join(60)
    status, _, body = results["generate"]
    assert status == 503 and "cut off by server shutdown" in body["error"]
    status, _, text = results["stream"]
    if status == 200:  # it had streamed: the last event carries the error
        assert "cut off by server shutdown" in text.strip().splitlines()[-1]
    else:  # cut off before its first piece of text: an ordinary error response
        assert status == 503 and "cut off by server shutdown" in text["error"]
    assert isinstance(results["grpc"], InferenceServerException)
    assert "UNAVAILABLE" in str(results["grpc"].status()) and "cut off" in results["grpc"].message()


def _start_cli_server(engine, *extra):
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", "--engine", str(engine), "--model-name",
                             MODEL_NAME, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    match = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
    assert match, line + (proc.stdout.read() if proc.poll() is not None else "")
    return proc, int(match.group(1))


def _flood(port: int, count: int) -> list[socket.socket]:
    """`count` streaming requests in flight, each on its own connection (left open)."""
    body = json.dumps(LONG).encode()
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"POST {GENERATE}_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        socks.append(sock)
    return socks


def test_shutdown_ends_on_time_under_load_and_a_second_signal_exits_at_once(tiny_code_engine):
    proc, port = _start_cli_server(tiny_code_engine, "--shutdown-timeout", "1", "--max-connections", "2000")
    socks = _flood(port, 300)
    try:
        time.sleep(2.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(1 + 5 + 5) == 0, proc.stdout.read()
        assert time.monotonic() - start < 1 + 5
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()

    proc, port = _start_cli_server(tiny_code_engine, "--shutdown-timeout", "60")
    socks = _flood(port, 4)
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 1
        assert time.monotonic() - start < 3 and "exiting now" in proc.stdout.read()
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()
