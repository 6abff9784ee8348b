"""Every client recipe of docs/clients.md, run exactly as printed against a live `kiln serve` of the bundled
engine (issue 40): the ```bash blocks whose first line is `# recipe: NAME`, each with `bash -e -o pipefail` in
a scratch folder that links examples/, with KILN_HTTP, KILN_GRPC and KILN_METRICS naming the server's free
ports. Each must exit 0, its output must show that no request errored, and the server must have counted no
failed request. A client that is not installed is skipped, naming what is missing: commands are looked for on
PATH, then in ~/.cache/kiln/client-tools/*/bin (guidellm, AIPerf, genai-perf in virtual environments of their own;
KILN_CLIENT_TOOLS names another folder of such environments)."""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from serve_util import EXAMPLES, counters, start_server

DOC = Path(__file__).resolve().parent.parent / "docs" / "clients.md"
BLOCK = re.compile(r"^```bash\n# recipe: (\S+)\n(.*?)^```$", re.S | re.M)
TOOLS = Path(os.environ.get("KILN_CLIENT_TOOLS", "~/.cache/kiln/client-tools")).expanduser()
FAILED_OUTCOMES = ("error", "rejected", "overloaded", "abort")


def recipes() -> dict[str, str]:
    """name -> the block's commands, as docs/clients.md prints them."""
    return {name: body for name, body in BLOCK.findall(DOC.read_text())}


def tool_path() -> str:
    """This Python's scripts first (python, kiln, lm_eval), then PATH, then the client-tools environments."""
    extra = sorted(str(p) for p in TOOLS.glob("*/bin")) if TOOLS.is_dir() else []
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""), *extra])


# ---- what each client's output must show -------------------------------------------------------------------

def _openai(out: str) -> None:
    for label in ("completion:", "chat:", "stream:"):
        line = next((x for x in out.splitlines() if x.startswith(label)), None)
        assert line is not None and len(line) > len(label) + 3, f"no {label} line with text"


def _tritonclient(out: str) -> None:
    assert "http: 'def fibonacci(n):" in out
    responses = re.search(r"^grpc: .+ in (\d+) responses$", out, re.M)
    assert responses and int(responses.group(1)) > 0


def _kiln_bench_serve(out: str) -> None:
    done = re.search(r"requests \(completed / failed\)\s+(\d+) / (\d+)", out)
    assert done and (int(done.group(1)), int(done.group(2))) == (8, 0)


def _guidellm(out: str) -> None:
    printed = [line for line in out.splitlines() if line.startswith("{'successful'")]  # the recipe's own check
    totals = ast.literal_eval(printed[-1])
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == 8, totals
    assert re.search(r"successful=8 errored=0 incomplete=0", out)


def _lm_eval(out: str) -> None:
    row = re.search(r"^\|kiln_code_choice\|.*\|acc\s*\|.*\|\s*([0-9.]+)\|", out, re.M)
    assert row and 0.0 <= float(row.group(1)) <= 1.0


def _prometheus(out: str) -> None:
    assert re.search(r"^kiln_generation_tokens_total \d", out, re.M)
    errors = re.search(r'^kiln_requests_total\{outcome="error"\} ([0-9.e+]+)$', out, re.M)
    assert errors is None or float(errors.group(1)) == 0


def _perf_analyzer(out: str) -> None:  # not run on our machines (glibc 2.36): see docs/clients.md
    count = re.search(r"Request count: (\d+)", out)
    assert count and int(count.group(1)) > 0 and "error" not in out.lower()


def _genai_perf(out: str) -> None:  # not run on our machines: it runs perf_analyzer
    assert "LLM Metrics" in out and "Request Count" in out and "ERROR" not in out


def _aiperf(out: str) -> None:
    assert re.search(r"profiling\) complete \| completed=8, cancelled=0, errors=0", out)
    assert re.search(r"Request Error Rate \(%\) │\s+0\.00", out)


@dataclass(frozen=True)
class Client:
    modules: tuple[str, ...]  # Python modules the recipe imports (in this Python)
    commands: tuple[str, ...]  # executables it runs
    check: Callable[[str], None]
    hint: str = ""
    offline: bool = True  # run with HF_HUB_OFFLINE=1 (nothing may be downloaded)


PERF_HINT = (f"its wheel needs glibc 2.38 or newer, this machine has {platform.libc_ver()[1] or 'another libc'}; "
             f"`pip install perf-analyzer` here installs a placeholder without the binary")
CLIENTS = {
    "openai": Client(("openai",), ("python",), _openai),
    "tritonclient": Client(("tritonclient.http", "tritonclient.grpc"), ("python",), _tritonclient),
    "kiln-bench-serve": Client((), ("kiln",), _kiln_bench_serve),
    "guidellm": Client((), ("guidellm", "python3"), _guidellm, "in its own venv: docs/clients.md#guidellm"),
    "lm-eval": Client(("transformers",), ("lm_eval",), _lm_eval),
    "prometheus": Client((), ("curl",), _prometheus),
    "perf_analyzer": Client((), ("perf_analyzer",), _perf_analyzer, PERF_HINT),
    "genai-perf-kserve": Client((), ("genai-perf", "perf_analyzer"), _genai_perf, PERF_HINT),
    "genai-perf-openai": Client((), ("genai-perf", "perf_analyzer"), _genai_perf, PERF_HINT),
    # AIPerf 0.13 with HF_HUB_OFFLINE looks even a local tokenizer up in the hub's cache (and fails); without it,
    # a local folder is read as is (nothing is downloaded either: our machines reach no hub)
    "aiperf": Client((), ("aiperf",), _aiperf, "in its own venv: docs/clients.md#aiperf", offline=False),
}


def test_every_recipe_of_the_doc_has_a_check():
    assert set(recipes()) == set(CLIENTS)


@pytest.fixture(scope="module")
def live_server(tiny_code_engine):
    """`kiln serve` as the doc starts it: the bundled engine with its own chat template (no --chat-template)."""
    server = start_server(tiny_code_engine, chat_template=None)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The folder the recipes run in: examples/ as in the clone's root, and room for their report files."""
    directory = tmp_path_factory.mktemp("client-recipes")
    (directory / "examples").symlink_to(EXAMPLES)
    return directory


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_recipe_runs_as_printed(name, live_server, scratch):
    client, script = CLIENTS[name], recipes()[name]
    path = tool_path()
    missing = [m for m in client.modules if _find_module(m) is None]
    missing += [c for c in client.commands if shutil.which(c, path=path) is None]
    if missing:
        pytest.skip(f"{name}: {', '.join(missing)} not installed" + (f" ({client.hint})" if client.hint else ""))
    env = {key: value for key, value in os.environ.items() if key not in ("KILN_API_KEY", "VIRTUAL_ENV")}
    env.update(PATH=path, KILN_HTTP=live_server.http_url, KILN_GRPC=live_server.grpc_url,
               KILN_METRICS=live_server.metrics_url.removeprefix("http://").removesuffix("/metrics"))
    if client.offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    before = _failed(live_server)
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=scratch, env=env,
                            capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{out[-4000:]}"
    try:
        client.check(out)
    except (AssertionError, ValueError, SyntaxError, IndexError) as e:
        raise AssertionError(f"{name}'s output does not show every request succeeding ({e!r}):\n{out[-4000:]}") \
            from None
    assert _failed(live_server) == before, f"{name}: the server counted failed requests"


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _failed(server) -> dict[str, float]:
    return {key: value for key, value in counters(server).items()
            if any(f'outcome="{outcome}"' in key for outcome in FAILED_OUTCOMES)}
