"""Compiling an engine's kernels at build time and storing them in the engine (`kernels/triton/`).

The engine, finished but for its kernels, is loaded in a child process whose Triton cache is a new empty
directory; the child runs the runtime's startup (activation profile, every CUDA graph size) and the launches of
a first stretch of serving (`kiln.runtime.engine.kernel_warmup`). Whatever Triton wrote there is exactly what serving
this engine compiles: the compiled kernels (metadata and binary of each; the intermediate IRs are left out)
and the launcher modules. They are copied into the engine, each file in the manifest, and engine.json's
`target.kernels` records the toolchain (see `kiln.engine_format.kernels`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.engine_format import FileEntry, file_entry, load_engine_spec
from kiln.engine_format.kernels import (
    BINARY_SUFFIXES,
    GROUP_PREFIX,
    KERNELS_DIR,
    LAUNCHER_SUFFIX,
    KernelTarget,
    current_toolchain,
    is_group,
    read_kernel_target,
    relative_group,
)

logger = logging.getLogger("kiln.builder")

WARMUP_TIMEOUT_S = 1800  # a cold 70B-class warm-up compiles a few hundred kernels; a hang must still end


class KernelStoreError(Exception):
    """The kernels could not be compiled or collected; the message says why and names --no-kernels."""


@dataclass(frozen=True)
class StoredKernels:
    """What `store_kernels` put into the engine: manifest entries and engine.json's `target.kernels`."""

    files: dict[str, FileEntry]
    target: KernelTarget
    seconds: float

    def summary(self) -> str:
        return describe(self.target)


def describe(target: KernelTarget) -> str:
    """One line for `kiln build`: how many kernels, their size, and what for."""
    return (f"kernels: {target.num_kernels} compiled kernels and {target.num_launchers} launchers stored "
            f"({target.total_bytes / 2**20:,.1f} MiB) for {target.toolchain.describe()}")


def stored_kernels_line(engine_dir: Path) -> str | None:
    """`kiln build`'s line about the engine's stored kernels; None for an engine that targets the CPU."""
    spec = load_engine_spec(engine_dir, verify_checksums=False)
    if spec.target.get("device_type") != "cuda":
        return None
    target = read_kernel_target(spec.engine_dir, spec.target)
    if target is None:
        return ("kernels: none stored (--no-kernels, or a tensor-parallel engine): each machine compiles them at "
                "first use")
    return describe(target)


def store_kernels(engine_dir: Path, device_index: int | None = None) -> StoredKernels:
    """Compiles every kernel serving `engine_dir` launches on this GPU and stores them in it (engine_dir must be
    a complete engine: engine.json written). Returns the files and the target record to add to engine.json."""
    start = time.perf_counter()
    index = torch.cuda.current_device() if device_index is None else device_index
    toolchain = current_toolchain(index)
    with tempfile.TemporaryDirectory(prefix="kiln-kernels-") as tmp:
        cache = Path(tmp) / "triton"
        cache.mkdir()
        run_warmup(engine_dir, cache, index)
        files, kernels, launchers = collect_kernels(cache, engine_dir)
    target = KernelTarget(toolchain, num_kernels=kernels, num_launchers=launchers,
                          total_bytes=sum(e.size for e in files.values()))
    stored = StoredKernels(files, target, time.perf_counter() - start)
    logger.info("%s in %.1fs", stored.summary(), stored.seconds)
    return stored


def with_stored_kernels(engine_dir: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """engine.json's fields (`write_engine_json`'s keywords, written to `engine_dir` already) with the kernels
    that serving the engine compiles stored in it: its files listed, `target.kernels` set. A tensor-parallel
    engine stores none yet (its warm-up would need every rank's GPU): its fields come back as they were."""
    from kiln.plugins._triton import USE_TRITON

    if fields["mapping"].get("tp_size", 1) > 1 or not USE_TRITON:
        logger.warning("no kernels stored: %s", "kernels are not stored for tensor-parallel engines yet (each rank "
                       "compiles its kernels at first use)" if USE_TRITON else "Triton is not installed or "
                       "KILN_DISABLE_TRITON=1 (the runtime then runs the PyTorch references)")
        return fields
    stored = store_kernels(engine_dir)
    return {**fields, "files": {**fields["files"], **stored.files},
            "target": {**fields["target"], "kernels": stored.target.to_dict()}}


def run_warmup(engine_dir: Path, triton_cache: Path, device_index: int) -> None:
    """Runs `kiln.runtime.engine.kernel_warmup` on the engine in a child process whose Triton cache is `triton_cache`;
    a KernelStoreError with the end of its output when it fails."""
    torch.cuda.empty_cache()  # the child sizes its KV cache from the memory left free
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    command = [sys.executable, "-m", "kiln.runtime.engine.kernel_warmup", str(engine_dir.resolve()), "--device",
               f"cuda:{device_index}"]
    try:  # run from the cache's folder: a `kiln/` folder in the current one (a checkout) would shadow the package
        done = subprocess.run(command, env=env, cwd=triton_cache.parent, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=WARMUP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise KernelStoreError(f"compiling the engine's kernels took over {WARMUP_TIMEOUT_S} s; build with "
                               f"--no-kernels to skip it (the runtime then compiles them at first use)") from None
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        raise KernelStoreError(f"compiling the engine's kernels failed (exit {done.returncode}):\n{tail}\nbuild with "
                               f"--no-kernels to skip it (the runtime then compiles them at first use)")
    for line in done.stdout.splitlines():
        if "kernel warm-up" in line:
            logger.info("%s", line.split(": ", 1)[-1])


def collect_kernels(cache: Path, engine_dir: Path) -> tuple[dict[str, FileEntry], int, int]:
    """Copies Triton's cache entries in `cache` into engine_dir/kernels/triton: each compiled kernel's metadata
    and binary with its group file rewritten to bare names, and each launcher module. Returns the manifest
    entries, the number of kernels and of launchers. Triton's temporary and lock files are left out."""
    files: dict[str, FileEntry] = {}
    kernels = launchers = 0
    for entry in sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith("tmp.")):
        names = {p.name for p in entry.iterdir() if p.is_file()}
        groups = sorted(n for n in names if is_group(n))
        keep: dict[str, str | None] = {}  # file name -> new text (groups) or None (copied as is)
        for group in groups:
            metadata = group.removeprefix(GROUP_PREFIX)
            children = set(json.loads((entry / group).read_text())["child_paths"])
            wanted = {metadata} | {n for n in children if n.endswith(BINARY_SUFFIXES)}
            if len(wanted) < 2 or not wanted <= names:
                logger.warning("Triton cache entry %s lacks the metadata or binary its group %s names; left out",
                               entry.name, group)
                continue
            keep[group] = relative_group((entry / group).read_text(), wanted)
            keep.update(dict.fromkeys(wanted))
            kernels += 1
        modules = [n for n in names if n.endswith(LAUNCHER_SUFFIX)] if not groups else []
        keep.update(dict.fromkeys(modules))
        launchers += len(modules)
        if not keep:
            continue
        dest = engine_dir / KERNELS_DIR / entry.name
        dest.mkdir(parents=True, exist_ok=True)
        for name, text in sorted(keep.items()):
            if text is None:
                shutil.copyfile(entry / name, dest / name)
            else:
                (dest / name).write_text(text)
            files[f"{KERNELS_DIR}/{entry.name}/{name}"] = file_entry(dest / name)
    return files, kernels, launchers

