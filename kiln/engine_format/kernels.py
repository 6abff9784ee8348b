"""The compiled kernels an engine carries: Triton's cache entries for the GPU and toolchain it was built on.

`kiln build --device cuda` launches every kernel the runtime will launch for the engine with an empty Triton
cache and stores what Triton wrote, so that a machine serving it compiles nothing. Layout:

    kernels/triton/<entry>/<name>.json         a kernel's metadata (Triton's)
    kernels/triton/<entry>/<name>.cubin        its binary
    kernels/triton/<entry>/__grp__<name>.json  its group: {"child_paths": {file name: file name}}
    kernels/triton/<entry>/<module>.so         or: a compiled launcher module (Triton compiles one per signature)

`<entry>` is Triton's own cache key (a hash of the kernel's source, options, target GPU and Triton build), so an
entry is only ever found by the Triton that wrote it. Triton's group files list absolute paths; the engine's
list bare names, which the runtime turns into the paths of its installed copy (`absolute_group`). Every file is
in the manifest with its sha256. engine.json's `target.kernels` (`KernelTarget`) says what they were compiled
for; on any other GPU model or toolchain the runtime leaves them out with a warning and Triton compiles as usual.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import EngineError
from .manifest import ENGINE_JSON, FileEntry

KERNELS_DIR = "kernels/triton"
GROUP_PREFIX = "__grp__"
BINARY_SUFFIXES = (".cubin", ".hsaco")  # Triton's `binary_ext` of its NVIDIA and AMD backends
LAUNCHER_SUFFIX = ".so"
_ENTRY_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Toolchain:
    """What a compiled kernel depends on: the GPU model and the software that compiled and launches it."""

    gpu_name: str
    compute_capability: tuple[int, int]
    triton_version: str
    torch_version: str
    cuda_version: str | None  # torch.version.cuda
    kiln_version: str  # the kernels' source (Triton's key hashes it, line numbers included)

    def describe(self) -> str:
        major, minor = self.compute_capability
        return (f"{self.gpu_name} (sm_{major}{minor}), Triton {self.triton_version}, torch {self.torch_version}, "
                f"CUDA {self.cuda_version}, kiln {self.kiln_version}")

    def differences(self, other: Toolchain) -> list[str]:
        """What differs between this toolchain and `other`, as `field this -> other` phrases; [] if nothing."""
        return [f"{name} {getattr(self, name)} -> {getattr(other, name)}" for name in _TOOLCHAIN_FIELDS
                if getattr(self, name) != getattr(other, name)]


_TOOLCHAIN_FIELDS = ("gpu_name", "compute_capability", "triton_version", "torch_version", "cuda_version",
                     "kiln_version")


@dataclass(frozen=True)
class KernelTarget:
    """engine.json `target.kernels`: the toolchain the stored kernels were compiled with, and how many."""

    toolchain: Toolchain
    num_kernels: int  # compiled kernels (a group each)
    num_launchers: int  # compiled launcher modules
    total_bytes: int  # every stored file

    def to_dict(self) -> dict[str, Any]:
        tc = self.toolchain
        return {"format": "triton_cache", "dir": KERNELS_DIR, "gpu_name": tc.gpu_name,
                "compute_capability": list(tc.compute_capability), "triton_version": tc.triton_version,
                "torch_version": tc.torch_version, "cuda_version": tc.cuda_version, "kiln_version": tc.kiln_version,
                "num_kernels": self.num_kernels, "num_launchers": self.num_launchers, "total_bytes": self.total_bytes}

    @classmethod
    def from_dict(cls, raw: object, where: str) -> KernelTarget:
        """Parses `raw`; a ValueError naming `where`.field and its value when a field is missing or mistyped."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} is {raw!r:.80}, not an object")
        if raw.get("format") != "triton_cache" or raw.get("dir") != KERNELS_DIR:
            raise ValueError(f"{where}: format {raw.get('format')!r} in {raw.get('dir')!r} is not one this kiln "
                             f"reads ('triton_cache' in {KERNELS_DIR!r})")

        def field(name: str, types: tuple[type, ...]) -> Any:
            value = raw.get(name)
            if isinstance(value, bool) or not isinstance(value, types):
                raise ValueError(f"{where}.{name} is {value!r:.80}: expected "
                                 f"{' or '.join('null' if t is type(None) else t.__name__ for t in types)}")
            return value

        capability = field("compute_capability", (list,))
        if len(capability) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in capability):
            raise ValueError(f"{where}.compute_capability is {capability!r}: expected [major, minor]")
        counts = {name: field(name, (int,)) for name in ("num_kernels", "num_launchers", "total_bytes")}
        if any(v < 0 for v in counts.values()):
            raise ValueError(f"{where}: counts must be >= 0, got {counts}")
        toolchain = Toolchain(gpu_name=field("gpu_name", (str,)), compute_capability=(capability[0], capability[1]),
                              triton_version=field("triton_version", (str,)),
                              torch_version=field("torch_version", (str,)),
                              cuda_version=field("cuda_version", (str, type(None))),
                              kiln_version=field("kiln_version", (str,)))
        return cls(toolchain, **counts)


def current_toolchain(device) -> Toolchain:
    """The toolchain of this process on CUDA device `device` (a torch.device or index)."""
    import torch
    import triton

    from .. import __version__

    major, minor = torch.cuda.get_device_capability(device)
    return Toolchain(gpu_name=torch.cuda.get_device_name(device), compute_capability=(major, minor),
                     triton_version=triton.__version__, torch_version=torch.__version__,
                     cuda_version=torch.version.cuda, kiln_version=__version__)


def read_kernel_target(engine_dir: Path, target: dict[str, Any]) -> KernelTarget | None:
    """The engine's `target.kernels`, None when it carries no kernels; an EngineError naming engine.json and the
    field when it cannot be read."""
    raw = target.get("kernels")
    if raw is None:
        return None
    try:
        return KernelTarget.from_dict(raw, "target.kernels")
    except ValueError as e:
        raise EngineError(f"{engine_dir / ENGINE_JSON}: {e}; rebuild the engine with `kiln build --device cuda` "
                          f"(or with --no-kernels to store none)") from None


def kernel_files(files: dict[str, FileEntry]) -> dict[str, FileEntry]:
    """The manifest's kernel files by path (`kernels/triton/<entry>/<file>`)."""
    prefix = KERNELS_DIR + "/"
    return {path: entry for path, entry in files.items() if path.startswith(prefix)}


def split_kernel_path(path: str) -> tuple[str, str]:
    """(entry, file name) of a manifest path under KERNELS_DIR; ValueError for anything deeper or oddly named
    (the runtime joins these names to its cache directory)."""
    parts = PurePosixPath(path).relative_to(KERNELS_DIR).parts
    if len(parts) != 2 or not all(_ENTRY_NAME.fullmatch(p) for p in parts):
        raise ValueError(f"kernel file {path!r} must be {KERNELS_DIR}/<entry>/<file>, names of letters, digits, "
                         f"'_', '.' and '-'")
    return parts[0], parts[1]


def is_group(name: str) -> bool:
    return name.startswith(GROUP_PREFIX) and name.endswith(".json")


def relative_group(text: str, names: set[str]) -> str:
    """An engine's group file from Triton's (`{"child_paths": {name: absolute path}}`), listing only `names`."""
    children = json.loads(text)["child_paths"]
    return json.dumps({"child_paths": {name: name for name in sorted(children) if name in names}})


def absolute_group(text: str, entry_dir: Path) -> str:
    """Triton's group file for an engine's (`text`) whose files were installed into `entry_dir`."""
    children = json.loads(text)["child_paths"]
    if not isinstance(children, dict) or not all(isinstance(n, str) and _ENTRY_NAME.fullmatch(n) for n in children):
        raise ValueError(f"group file lists {children!r:.120}, not file names")
    return json.dumps({"child_paths": {name: str(entry_dir / name) for name in children}})
