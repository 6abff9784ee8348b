"""A real Triton Inference Server for tests: the `tritonserver` (2.51, CPU builds work) and Python-backend stub
bundled in the nvidia-pytriton 0.7.0 wheel, serving a repository written by `kiln triton-repo`.

Where the wheel is (the first that exists; when none does, the tests install it into the cache directory
below with pip, unless KILN_TEST_TRITON_INSTALL=0):
  $KILN_TEST_TRITON_HOME, else ~/.cache/kiln/triton-server   a `pip install --target` directory, made with
      pip install --no-deps --target ~/.cache/kiln/triton-server nvidia-pytriton==0.7.0 "numpy<2"
      (--no-deps: the wheel's own dependencies are tritonclient & co., already in kiln's test extra);
  else nvidia-pytriton installed in this Python (it pins numpy<2 there, which breaks pandas 3).

The stub links the system's libpython3.X.so.1.0 (X: this Python's minor version) and runs that interpreter;
model.py finds kiln through kiln_env.json (this venv's site directories). That interpreter needs numpy<2
(the stub crashes on BYTES inputs with numpy 2): the numpy<2 of the directory above is put first on its
sys.path through `kiln triton-repo --python-path`, or this Python's numpy when it is older than 2.
Nothing in the wheel's directory is modified: the backend is laid out in a temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOME = Path("~/.cache/kiln/triton-server").expanduser()
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


class Unavailable(Exception):
    """What is missing to run a real Triton here (the tests skip with this message)."""


@dataclass(frozen=True)
class TritonInstall:
    root: Path  # the directory holding pytriton/ and nvidia_pytriton.libs/
    numpy_dir: Path | None  # a directory with numpy<2 to put first on the stub's sys.path (None: not needed)

    @property
    def server_dir(self) -> Path:
        return self.root / "pytriton" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.root / "nvidia_pytriton.libs"

    @property
    def binary(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        return self.server_dir / "python_backend_stubs" / PY / "triton_python_backend_stub"

    def env(self) -> dict[str, str]:
        """tritonserver's environment: the wheel's libraries on LD_LIBRARY_PATH, and no virtual environment
        on PATH. The stub embeds the system's libpython, which looks for its prefix through the first
        `python3` on PATH: a venv's (pyvenv.cfg) would give it another Python's standard library (there:
        `undefined symbol: _PyModule_Add`)."""
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
        env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                      if d and not (Path(d).parent / "pyvenv.cfg").is_file())
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.libs), env.get("LD_LIBRARY_PATH")]))
        return env


def _numpy_major(directory: Path) -> int | None:
    versions = sorted(directory.glob("numpy-*.dist-info"))
    if not (directory / "numpy").is_dir() or not versions:
        return None
    return int(versions[-1].name.split("-")[1].split(".")[0])


def find_install() -> TritonInstall:
    """The nvidia-pytriton install to use; raises Unavailable (with what to do) if there is none usable."""
    home = os.environ.get("KILN_TEST_TRITON_HOME")
    candidates = [Path(home)] if home else [DEFAULT_HOME]
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]).parent)
    root = next((c for c in candidates if (c / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file()), None)
    if root is None and not home and os.environ.get("KILN_TEST_TRITON_INSTALL", "1") != "0":
        root = _install(DEFAULT_HOME)
    if root is None:
        raise Unavailable(f"nvidia-pytriton is not installed (looked in {', '.join(map(str, candidates))}): "
                          f'pip install --no-deps --target {DEFAULT_HOME} nvidia-pytriton==0.7.0 "numpy<2" '
                          f"(or set KILN_TEST_TRITON_HOME to such a directory)")
    import numpy

    numpy_dir = None
    if int(numpy.__version__.split(".")[0]) >= 2:
        major = _numpy_major(root)
        if major is None or major >= 2:
            raise Unavailable(f"Triton's Python-backend stub needs numpy<2 and this Python has numpy "
                              f'{numpy.__version__}: pip install --no-deps --target {root} "numpy<2"')
        numpy_dir = root
    install = TritonInstall(root, numpy_dir)
    if not install.stub.is_file():
        raise Unavailable(f"nvidia-pytriton has no Python-backend stub for Python {PY} ({install.stub})")
    missing = _missing_libraries(install)
    if missing:
        raise Unavailable(f"the Triton stub for Python {PY} lacks shared libraries: {missing} "
                          f"(the system's libpython{PY}, e.g. apt install libpython{PY})")
    return install


def _install(target: Path) -> Path | None:
    """Installs the wheel (and numpy<2 for the stub) into `target` with pip, as the module docstring says, so
    that CI tests the real server from nothing; None when pip cannot (no index, no wheel for this platform).
    KILN_TEST_TRITON_INSTALL=0 turns this off."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
                             "nvidia-pytriton==0.7.0", "numpy<2"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        return None
    partial.rename(target)  # whole or not at all: a half-made directory is never found above
    return target


def _missing_libraries(install: TritonInstall) -> list[str]:
    missing = []
    for binary in (install.binary, install.stub):
        out = subprocess.run(["ldd", str(binary)], env=install.env(), capture_output=True, text=True).stdout
        missing += [line.split()[0] for line in out.splitlines() if "not found" in line]
    return missing


def layout_backend(install: TritonInstall, directory: Path) -> tuple[Path, Path | None]:
    """DIR/backends/python (libtriton_python.so, the stub for this Python, triton_python_backend_utils.py) and
    DIR/numpy1 (links to the numpy<2 package, when one is needed): copies, leaving the wheel as it is."""
    backends = directory / "backends"
    python = backends / "python"
    python.mkdir(parents=True)
    source = install.server_dir / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(source / name, python / name)
    shutil.copy2(install.stub, python / "triton_python_backend_stub")
    numpy_dir = None
    if install.numpy_dir is not None:
        numpy_dir = directory / "numpy1"
        numpy_dir.mkdir()
        for name in ("numpy", "numpy.libs"):
            if (install.numpy_dir / name).exists():
                (numpy_dir / name).symlink_to(install.numpy_dir / name)
    return backends, numpy_dir


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class TritonServer:
    """A tritonserver process in its own process group (the stubs are its children)."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_file: Path
    stopped: bool = field(default=False)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait_ready(self, model: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"{self.http_base}/v2/models/{model}/ready"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"model {model} not READY after {timeout:.0f} s:\n{self.log()[-6000:]}")
            time.sleep(0.25)

    def stub_cpu_seconds(self) -> float:
        """CPU time used so far by the Python-backend stubs (the server's process group, less the server)."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.process.pid:
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.process.pid:  # pgrp
                total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        return total

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGINT (Triton's graceful shutdown: it waits up to exit_timeout for requests in flight), then
        SIGKILL to the whole group if it outlives `timeout`."""
        if self.stopped:
            return self.process.returncode
        self.stopped = True
        self.signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.process.wait(10)
        finally:
            self.signal(signal.SIGKILL)  # stubs left behind by a crashed server


def start_server(install: TritonInstall, repo: Path, backends: Path, log_file: Path, *, load: list[str],
                 exit_timeout_s: int = 30, extra_args: tuple[str, ...] = (), cwd: Path | None = None) -> TritonServer:
    """tritonserver on free loopback ports, models loaded explicitly (`load`), started in the folder `cwd` (the
    Python backend puts it on the stubs' sys.path); returns once it runs (see TritonServer.wait_ready)."""
    http, grpc, metrics = free_ports(3)
    args = [str(install.binary), f"--model-repository={repo}", f"--backend-directory={backends}",
            f"--cache-directory={install.server_dir / 'caches'}",
            "--http-address=127.0.0.1", f"--http-port={http}", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--metrics-address=127.0.0.1",
            f"--metrics-port={metrics}", "--model-control-mode=explicit", *(f"--load-model={m}" for m in load),
            f"--exit-timeout-secs={exit_timeout_s}", "--log-verbose=0", *extra_args]
    with open(log_file, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=install.env(), start_new_session=True, cwd=cwd)
    return TritonServer(process, http, grpc, metrics, log_file)
