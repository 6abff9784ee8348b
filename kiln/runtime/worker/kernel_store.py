"""Installing the compiled kernels an engine carries (`kernels/triton/`, see `kiln.engine_format.kernels`)
into Triton's cache before the first launch, so that a fresh machine compiles nothing.

The engine directory is never written: each stored cache entry is copied into the cache directory Triton uses
in this process (`TRITON_CACHE_DIR`, default ~/.triton/cache), the group files pointing at the copies. That
cache is an overlay: entries already there stay (Triton names an entry by the hash of everything that
compiled it, so an entry of the same name holds the same kernel), and kernels the engine lacks still compile
there as usual. Where that directory cannot be written, a private temporary one is used and Triton pointed
at it. Every copied file is checked against the manifest's sha256 on the way: a tampered kernel is refused.

On a GPU model or toolchain other than the build's, nothing is installed: a warning (once per engine and
process) names both, and Triton compiles the kernels here as it would without stored ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.engine_format import EngineError, EngineSpec
from kiln.engine_format.kernels import (
    absolute_group,
    current_toolchain,
    is_group,
    kernel_files,
    read_kernel_target,
    split_kernel_path,
)

logger = logging.getLogger("kiln.runtime")


@dataclass(frozen=True)
class KernelInstall:
    """What `install_engine_kernels` did: `status` is "installed", "none" (the engine carries no kernels, or
    runs on the CPU) or "mismatch" (built for another GPU or toolchain: left out)."""

    status: str
    num_files: int = 0  # files copied now (entries already in the cache are not copied again)
    num_present: int = 0  # files found in the cache already
    cache_dir: str | None = None
    seconds: float = 0.0

    def describe(self) -> str:
        if self.status == "installed":
            return f"{self.num_files} kernel files installed, {self.num_present} already cached"
        return {"none": "none stored", "mismatch": "stored ones are for another GPU or toolchain"}[self.status]


_lock = threading.Lock()
_done: dict[tuple[str, str], KernelInstall] = {}  # (engine dir, device) -> what was done, once per process


def install_engine_kernels(spec: EngineSpec, device: torch.device) -> KernelInstall:
    """Installs the engine's stored kernels for `device` into Triton's cache (once per engine and device in a
    process; later calls return the first result). An EngineError names a stored file that does not match the
    manifest."""
    from kiln.plugins._triton import USE_TRITON

    target = read_kernel_target(spec.engine_dir, spec.target)
    if target is None or device.type != "cuda" or not USE_TRITON:  # without Triton the references run
        return KernelInstall("none")
    key = (str(spec.engine_dir.resolve()), str(device))
    with _lock:
        if key in _done:
            return _done[key]
        start = time.perf_counter()
        here = current_toolchain(device)
        differences = target.toolchain.differences(here)
        if differences:
            logger.warning("engine %s carries kernels compiled for %s, but this is %s (%s): they are left out and "
                           "Triton compiles its kernels here at first use; rebuild the engine on this machine "
                           "(kiln build --device cuda) to store this GPU's", spec.engine_dir,
                           target.toolchain.describe(), here.describe(), "; ".join(differences))
            result = KernelInstall("mismatch", seconds=time.perf_counter() - start)
        else:
            cache = triton_cache_dir()
            try:
                copied, present = _install(spec, cache)
            except OSError as e:
                cache = Path(tempfile.mkdtemp(prefix="kiln-triton-cache-"))
                logger.warning("cannot write Triton's cache %s (%s): the engine's kernels go to %s, which Triton "
                               "now uses in this process", triton_cache_dir(), e, cache)
                copied, present = _install(spec, cache)
                point_triton_at(cache)
            result = KernelInstall("installed", copied, present, str(cache), time.perf_counter() - start)
            logger.info("kernels of engine %s (%d compiled, %d launchers, for %s): %s in %s in %.2fs",
                        spec.engine_dir, target.num_kernels, target.num_launchers, here.gpu_name,
                        result.describe(), cache, result.seconds)
        _done[key] = result
        return result


def triton_cache_dir() -> Path:
    """The directory Triton caches compiled kernels in, in this process."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton before 3.4 reads the variable itself
        default = Path.home() / ".triton" / "cache"
        return Path(os.environ["TRITON_CACHE_DIR"]) if os.environ.get("TRITON_CACHE_DIR") else default


def point_triton_at(cache: Path) -> None:
    """Makes Triton cache in `cache`, in this process and the processes it starts (tensor-parallel ranks)."""
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    try:
        from triton import knobs

        knobs.cache.dir = str(cache)
    except (ImportError, AttributeError):
        pass


def _install(spec: EngineSpec, cache: Path) -> tuple[int, int]:
    """Copies the engine's kernel files into `cache` (groups last in each entry, so Triton never sees a group
    whose files are not there yet); returns (files copied, files already present)."""
    by_entry: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(kernel_files(spec.files)):
        try:
            entry, name = split_kernel_path(path)
        except ValueError as e:
            raise EngineError(f"{spec.engine_dir / 'engine.json'}: {e}; rebuild the engine") from None
        by_entry.setdefault(entry, []).append((name, path))
    copied = present = 0
    for entry, members in by_entry.items():
        dest = cache / entry
        if all((dest / name).is_file() for name, _ in members):
            present += len(members)
            continue
        dest.mkdir(parents=True, exist_ok=True)
        for name, path in sorted(members, key=lambda m: is_group(m[0])):
            data = _checked_bytes(spec, path)
            if is_group(name):
                data = absolute_group(data.decode(), dest).encode()
            _write_atomic(dest / name, data)
            copied += 1
    return copied, present


def _checked_bytes(spec: EngineSpec, path: str) -> bytes:
    try:
        data = (spec.engine_dir / path).read_bytes()
    except OSError as e:
        raise EngineError(f"cannot read {spec.engine_dir / path}: {e}; check its permissions or rebuild the "
                          f"engine") from e
    expected = spec.files[path].sha256
    if hashlib.sha256(data).hexdigest() != expected:
        raise EngineError(f"engine directory {spec.engine_dir}: {path} has sha256 that differs from the manifest's "
                          f"{expected}: modified or corrupt; a kernel file is never loaded unchecked. Rebuild the "
                          f"engine (`kiln build --device cuda ...`) or copy it again completely")
    return data


def _write_atomic(path: Path, data: bytes) -> None:
    # Ranks of one engine install into one cache at once: each file appears whole or not at all.
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
