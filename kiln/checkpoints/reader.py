"""Lazy, name-addressed reading of Hugging Face checkpoint weights (safetensors or PyTorch .bin)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

# safetensors dtype name -> torch dtype. The builder's writer (safetensors_writer.py) uses the same table.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# Pickles that trainers leave next to the weights; they hold no tensors and weights_only rejects them.
_NON_WEIGHT_BINS = frozenset({"training_args.bin", "optimizer.bin", "scheduler.bin", "rng_state.bin"})

_LOOKED_FOR = f"{SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, *.safetensors, {BIN_INDEX}, {BIN_SINGLE}, *.bin"


class CheckpointError(Exception):
    """A checkpoint that cannot be read; the message names the directory, file or tensor at fault."""


class CheckpointReader:
    """Lazy, name-addressed access to the tensors of an HF checkpoint directory.

    Layouts, tried in this order: sharded safetensors with `model.safetensors.index.json`,
    `model.safetensors`, any other `*.safetensors` files, sharded `.bin` with
    `pytorch_model.bin.index.json`, `pytorch_model.bin`, any other `*.bin` files.
    safetensors files are memory-mapped and only the requested tensor is read, so peak memory stays
    near one tensor. `.bin` files are pickles: each is loaded (memory-mapped when possible) on first
    use of one of its names and kept until `close()`.
    """

    def __init__(self, checkpoint_dir: str | Path):
        self.checkpoint_dir = Path(checkpoint_dir)
        if not self.checkpoint_dir.is_dir():
            raise CheckpointError(
                f"checkpoint directory {self.checkpoint_dir} does not exist or is not a directory"
            )
        self._safetensors_handles: dict[Path, Any] = {}
        self._bin_contents: dict[Path, dict[str, torch.Tensor]] = {}
        self._closed = False
        self.format, self._file_of = self._locate_tensors()

    # -- public interface ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint, sorted."""
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, read from the file header (safetensors) without loading its data."""
        path = self._path_of(name)
        if self.format == "safetensors":
            return tuple(self._safetensors_slice(path, name).get_shape())
        return tuple(self._bin_tensor(path, name).shape)

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype, read from the file header (safetensors) without loading its data."""
        path = self._path_of(name)
        if self.format == "safetensors":
            dtype_name = self._safetensors_slice(path, name).get_dtype()
            try:
                return SAFETENSORS_DTYPES[dtype_name]
            except KeyError:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has safetensors dtype {dtype_name!r}, which kiln does not "
                    f"support (supported: {', '.join(SAFETENSORS_DTYPES)})"
                ) from None
        return self._bin_tensor(path, name).dtype

    def get(self, name: str) -> torch.Tensor:
        """Load just this tensor onto the CPU."""
        path = self._path_of(name)
        if self.format == "safetensors":
            handle = self._safetensors_handle(path)
            self._check_in_shard(path, name, handle.keys())
            try:
                return handle.get_tensor(name)
            except SafetensorError as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
        return self._bin_tensor(path, name)

    def close(self) -> None:
        """Release open files and cached .bin contents; the reader cannot be used afterwards."""
        self._safetensors_handles.clear()
        self._bin_contents.clear()
        self._closed = True

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.checkpoint_dir)!r}, format={self.format!r}, tensors={len(self._file_of)})"

    # -- finding the files --------------------------------------------------------------------------

    def _locate_tensors(self) -> tuple[str, dict[str, Path]]:
        """(format, tensor name -> file) for the first layout present in the directory."""
        root = self.checkpoint_dir
        if (root / SAFETENSORS_INDEX).is_file():
            return "safetensors", self._read_index(root / SAFETENSORS_INDEX)
        if (root / SAFETENSORS_SINGLE).is_file():
            return "safetensors", self._scan_files([root / SAFETENSORS_SINGLE])
        safetensors_files = sorted(root.glob("*.safetensors"))
        if safetensors_files:
            return "safetensors", self._scan_files(safetensors_files)
        if (root / BIN_INDEX).is_file():
            return "bin", self._read_index(root / BIN_INDEX)
        if (root / BIN_SINGLE).is_file():
            return "bin", self._scan_files([root / BIN_SINGLE])
        bin_files = sorted(p for p in root.glob("*.bin") if p.name not in _NON_WEIGHT_BINS)
        if bin_files:
            return "bin", self._scan_files(bin_files)
        raise CheckpointError(f"checkpoint directory {root} has no weight files; looked for {_LOOKED_FOR}")

    def _read_index(self, index_path: Path) -> dict[str, Path]:
        """The index's weight_map, checked to point only at shards that exist."""
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read checkpoint index {index_path}: {e}") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f'checkpoint index {index_path} has no "weight_map" object mapping tensor names to shard files'
            )
        file_of: dict[str, Path] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise CheckpointError(
                    f"checkpoint index {index_path}: tensor {name!r} maps to {shard!r}, expected a file name "
                    f"in {self.checkpoint_dir}"
                )
            file_of[name] = self.checkpoint_dir / shard
        missing = sorted({p.name for p in file_of.values() if not p.is_file()})
        if missing:
            raise CheckpointError(
                f"checkpoint index {index_path} refers to shard(s) missing from {self.checkpoint_dir}: "
                f"{', '.join(missing)}"
            )
        return file_of

    def _scan_files(self, paths: list[Path]) -> dict[str, Path]:
        """Tensor name -> file, by opening each file; a name found in two files is an error."""
        file_of: dict[str, Path] = {}
        for path in paths:
            if path.suffix == ".safetensors":
                names = list(self._safetensors_handle(path).keys())
            else:
                names = list(self._load_bin(path))
            for name in names:
                if name in file_of:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {file_of[name]} and {path}; "
                        f"add a {SAFETENSORS_INDEX} or {BIN_INDEX} to say which files belong to the model"
                    )
                file_of[name] = path
        return file_of

    # -- reading ------------------------------------------------------------------------------------

    def _path_of(self, name: str) -> Path:
        if self._closed:
            raise CheckpointError(f"checkpoint reader for {self.checkpoint_dir} is closed")
        try:
            return self._file_of[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {name!r} is not in checkpoint {self.checkpoint_dir} ({len(self._file_of)} tensors)"
            ) from None

    def _safetensors_handle(self, path: Path) -> Any:
        handle = self._safetensors_handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"safetensors file {path} is corrupt or unreadable: {e}") from e
            self._safetensors_handles[path] = handle
        return handle

    def _safetensors_slice(self, path: Path, name: str) -> Any:
        handle = self._safetensors_handle(path)
        self._check_in_shard(path, name, handle.keys())
        return handle.get_slice(name)

    def _check_in_shard(self, path: Path, name: str, names_in_file: Any) -> None:
        # Only an index can claim a tensor its shard lacks; scanned files list what they hold.
        if name not in names_in_file:
            raise CheckpointError(
                f"the checkpoint index says tensor {name!r} is in {path}, but that file lacks it"
            )

    def _bin_tensor(self, path: Path, name: str) -> torch.Tensor:
        contents = self._load_bin(path)
        self._check_in_shard(path, name, contents)
        return contents[name]

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        contents = self._bin_contents.get(path)
        if contents is not None:
            return contents
        # mmap needs the zipfile format (torch >= 1.6 default); older pickles are read into memory.
        use_mmap = zipfile.is_zipfile(path)
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
        except Exception as e:  # torch.load raises many types for bad pickles
            raise CheckpointError(
                f"PyTorch weight file {path} is corrupt or not a plain state dict: {e}"
            ) from e
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise CheckpointError(
                f"PyTorch weight file {path} holds a {type(loaded).__name__}, expected a dict of name -> tensor"
            )
        self._bin_contents[path] = loaded
        return loaded
