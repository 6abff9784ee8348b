"""Loading an engine directory: checks it, resolves runtime limits, builds one rank's network on its device.

Split in three so that an executor with several ranks can load the shared part once (`load_engine_info`:
engine.json, the typed configs, the tokenizer) and each rank its own weights (`load_network`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.engine_format import (
    ENGINE_JSON,
    EngineConfig,
    EngineError,
    EngineSpec,
    check_json_fields,
    load_engine_spec,
    read_engine_config,
)
from kiln.model_defs import CausalLM, ModelConfig, ModelConfigError, ModelDef, build_network, get_model_def
from kiln.model_defs.dummy_weights import draw_dummy_weights
from kiln.model_defs.layers.parallel import TPComm
from kiln.model_defs.rope_params import kv_depends_on_sequence_length
from kiln.quant.base import QuantConfig, QuantError
from kiln.quant.spec import QuantSpec
from kiln.runtime.options import RuntimeOptions, runtime_options
from kiln.runtime.worker.kernel_settings import install_kernel_settings
from kiln.runtime.worker.kernel_store import install_engine_kernels
from kiln.runtime.worker.weight_reader import read_weights

logger = logging.getLogger("kiln.runtime")


@dataclass(frozen=True)
class RuntimeConfig:
    """The limits the runtime runs with: the engine's build limits or smaller ones given at load."""

    device: torch.device
    dtype: torch.dtype  # activations and unquantized weights
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    num_kv_blocks: int | None  # None until the executor has sized the cache from memory
    enable_prefix_caching: bool
    kv_cache_memory_fraction: float = 0.9  # share of the memory left after weights and activations
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (on CUDA)
    kv_cache_dtype: torch.dtype | None = None  # the KV cache's own dtype; None = `dtype`
    # Schedule each step before the one in flight is read back, its tokens fed on the device (engine.py);
    # None: where that overlaps work (CUDA), False: never, True: wherever the executor can (tests on the CPU).
    async_scheduling: bool | None = None
    capacity_scheduler_policy: str = "max_utilization"  # runtime/core/capacity.py
    enable_lora: bool = False  # LoRA adapters per request (worker/lora_slots.py)
    max_loras: int = 4  # device slots: the most distinct adapters in one step
    max_lora_rank: int = 16
    max_cpu_loras: int = 8  # adapters kept read in host memory
    kv_offloading_size: float = 0.0  # GiB of host KV tier over all tensor-parallel ranks (worker/kv_host_tier.py)
    kv_offloading_dir: str | None = None  # the disk tier's directory (the engine's side)
    kv_offloading_disk_size: float = 10.0  # GiB the disk tier may hold
    # Speculative decoding (set from the speculative config, not by users): the most tokens one request's verify
    # step computes (1 + drafts, or 1 + a tree's nodes), whose steps run in CUDA graphs (worker/verify_graphs.py;
    # 0: none), whether they are trees, and the layers whose input residual streams an EAGLE-3 head reads.
    verify_tokens: int = 0
    verify_tree: bool = False
    feature_layers: tuple[int, ...] = ()

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    def host_kv_bytes(self, tp_size: int = 1) -> int:
        """Bytes of host KV tier one of `tp_size` ranks holds (each its share of kv_offloading_size)."""
        return int(self.kv_offloading_size * 2**30) // tp_size


@dataclass(frozen=True)
class EngineInfo:
    """What every process of an engine needs, without weights: engine.json read once, typed."""

    spec: EngineSpec
    model_def: ModelDef
    model_config: ModelConfig
    config: EngineConfig  # build_config and mapping
    tokenizer: object | None  # a transformers tokenizer, or None for an engine without tokenizer files


@dataclass(frozen=True)
class LoadedEngine(EngineInfo):
    """An engine with rank 0's network loaded in this process."""

    model: CausalLM | None = None


def load_engine_info(engine_dir: str | Path, *, verify_checksums: bool = True, tokenizer: bool = True) -> EngineInfo:
    """Reads and checks engine.json, the manifest and the tokenizer; raises EngineError saying what to do.

    With `verify_checksums` (the default) every file's sha256 is checked against the manifest, hashing
    only files that changed since they last matched; False checks sizes only. `tokenizer=False` skips
    loading it (a tensor-parallel worker rank never detokenizes)."""
    return engine_info(open_engine_spec(engine_dir, verify_checksums=verify_checksums), tokenizer=tokenizer)


def open_engine_spec(engine_dir: str | Path, *, verify_checksums: bool = True,
                     sha256_by_caller: bool = False) -> EngineSpec:
    """`load_engine_info`'s first half: engine.json and the manifest's sizes (and sha256s, unless
    `sha256_by_caller`: then the caller hashes them in the background, see `verify.start_verification`,
    while `engine_info` and the loading go on)."""
    _check_not_a_checkpoint(Path(engine_dir))
    return load_engine_spec(engine_dir, verify_checksums=verify_checksums, sha256_by_caller=sha256_by_caller)


def engine_info(spec: EngineSpec, *, tokenizer: bool = True) -> EngineInfo:
    """`load_engine_info`'s second half: the typed configs and the tokenizer of a checked `spec`."""
    hint = f"rebuild the engine with `kiln build --checkpoint ... --output {spec.engine_dir}`"
    try:
        model_def = get_model_def(spec.architecture)
    except ModelConfigError as e:
        raise EngineError(f"{spec.engine_dir / ENGINE_JSON}: architecture: {e}; upgrade kiln or {hint}") from None
    model_config = _read_model_config(spec, hint)
    config = read_engine_config(spec)
    loaded = None if spec.tokenizer_dir is None or not tokenizer else _load_tokenizer(spec.tokenizer_dir, hint)
    return EngineInfo(spec, model_def, model_config, config, loaded)


def _check_not_a_checkpoint(engine_dir: Path) -> None:
    """A Hugging Face checkpoint (config.json, no engine.json) passed where an engine belongs: say to build one
    from it, into another directory (building into the checkpoint itself would be refused)."""
    if engine_dir.is_dir() and (engine_dir / "config.json").is_file() and not (engine_dir / ENGINE_JSON).exists():
        raise EngineError(f"{engine_dir} has no {ENGINE_JSON} but a config.json: this looks like a Hugging Face "
                          f"checkpoint, not a kiln engine: build an engine from it with "
                          f"`kiln build --checkpoint {engine_dir} --output ENGINE_DIR`, then pass --engine ENGINE_DIR")


def _read_model_config(spec: EngineSpec, hint: str) -> ModelConfig:
    # Types are checked before ModelConfig is made: its own checks assume them ("abc" <= 0 is a TypeError).
    try:
        check_json_fields(ModelConfig, spec.model_config)
        return ModelConfig.from_dict(spec.model_config)
    except (ValueError, TypeError, KeyError) as e:  # ModelConfigError is a ValueError
        raise EngineError(f"{spec.engine_dir / ENGINE_JSON}: model_config: {_one_line(e)}; {hint}") from None


def _load_tokenizer(tokenizer_dir: Path, hint: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # transformers and tokenizers raise anything from KeyError to their own types
        raise EngineError(f"cannot load the tokenizer in {tokenizer_dir}: {_tokenizer_culprit(tokenizer_dir, e)}; "
                          f"{hint}") from e
    # kiln checks lengths itself (against max_seq_len, with a clear error); transformers' own warning
    # about model_max_length would only be noise, e.g. for perplexity over a long text in windows.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def _tokenizer_culprit(tokenizer_dir: Path, error: Exception) -> str:
    """Which file made loading the tokenizer fail, and why. transformers' own error often names neither
    (a damaged tokenizer.json surfaces as KeyError: 'added_tokens'), so the files are read again here."""
    names = sorted((p.name for p in tokenizer_dir.glob("*.json")), key=lambda n: (n != "tokenizer.json", n))
    for name in names:
        try:
            json.loads((tokenizer_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{name} is not valid JSON: {_one_line(e)}"
    if "tokenizer.json" in names:
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception subclass
            return f"tokenizer.json is not a valid tokenizer: {_one_line(e)}"
    return _one_line(error)


def _one_line(error: BaseException) -> str:
    """An exception as one line of at most 300 characters, with its type when the message alone is a bare key."""
    text = " ".join(str(error).split())
    if isinstance(error, KeyError) or not text:
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


def _override(name: str, value: int | None, built: int, flag: str) -> int:
    """`value` (a positive integer: RuntimeOptions checked it) if within the engine's built limit; None: built."""
    if value is None:
        return built
    if value > built:
        raise ValueError(f"{name}={value} exceeds the engine's built limit {built}; rebuild with {flag} {value}")
    return value


BUILD_DEVICES = ("cpu", "cuda")  # the device types kiln runs on, and `kiln build --device` targets


def resolve_device(spec: EngineSpec, device: str | torch.device | None) -> torch.device:
    """The device to run on: `device`, else the engine's target. An EngineError whose advice can work when
    `device` is of a type kiln does not run on, CUDA on a machine without it, or not the engine's target."""
    target = spec.target.get("device_type", "cpu")
    where = f"engine {spec.engine_dir} targets {target}"
    try:
        dev = torch.device(device if device is not None else target)
    except RuntimeError:  # torch's own message lists every device type it knows
        raise EngineError(f"device {device!r} is not a device kiln runs on: use cpu or cuda (cuda:N for GPU N); "
                          f"{where}") from None
    if dev.type not in BUILD_DEVICES:
        raise EngineError(f"device {dev.type!r} is not supported: kiln runs on cpu or cuda; {where}, so use "
                          f"--device {target} or leave --device out")
    no_cuda = "no CUDA device is available here"
    if dev.type == "cuda" and not torch.cuda.is_available():
        if target == "cuda":
            raise EngineError(f"{where} but {no_cuda}: run it on a machine with a CUDA GPU, or build an engine "
                              f"for this machine with `kiln build --device cpu --checkpoint ... --output ...`")
        raise EngineError(f"--device {device}: {no_cuda}; {where}: leave --device out")
    if dev.type != target:
        run_there = (f"run it with --device {target}" if target != "cuda" or torch.cuda.is_available() else
                     f"run it on a machine with a CUDA GPU ({no_cuda})")
        raise EngineError(f"engine {spec.engine_dir} was built for device type {target!r} but is loaded on "
                          f"{dev.type!r}: {run_there}, or rebuild it with `kiln build --device {dev.type}` (same "
                          f"--checkpoint, another --output) to run on {dev.type}")
    # A GPU other than the build's (another compute capability included) runs the engine: Triton compiles
    # the kernels for the GPU they run on; only the build's kernel tuning is the other GPU's, which
    # kernel_settings.py leaves out with a warning. Formats a GPU cannot run are refused by device_support.py.
    return dev


def _prefix_caching(info: EngineInfo, asked: bool, max_seq_len: int) -> bool:
    """Prefix caching as asked, but off (with a warning) where a block's keys depend on its sequence's length
    (longrope, dynamic NTK past the original context): a cached prefix would serve keys of the wrong length."""
    c = info.model_config
    if asked and kv_depends_on_sequence_length(c.rope, c.max_position_embeddings, max_seq_len):
        switch = c.rope.original_max_position_embeddings if c.rope.rope_type == "longrope" else \
            c.max_position_embeddings
        logger.warning("prefix caching is off: %s's %s rope rotates the keys of a sequence longer than %d tokens "
                       "by its length, so a cached prefix would not serve another length",
                       info.spec.architecture, c.rope.rope_type, switch)
        return False
    return asked


def resolve_runtime(info: EngineInfo, options: RuntimeOptions | None = None, /, **keywords) -> RuntimeConfig:
    """The runtime's limits: the engine's, or lower ones asked for (`options`, or RuntimeOptions' field names as
    keywords over it); a ValueError names the one too high."""
    options = runtime_options(options, keywords, "resolve_runtime")
    build = info.config.build
    device = resolve_device(info.spec, options.device)
    if device.type == "cuda" and info.model_def.cuda_refusal:
        raise ValueError(info.model_def.cuda_refusal)
    return RuntimeConfig(
        device=device, dtype=build.torch_dtype,
        max_batch_size=_override("max_batch_size", options.max_batch_size, build.max_batch_size, "--max-batch-size"),
        max_num_tokens=_override("max_num_tokens", options.max_num_tokens, build.max_num_tokens, "--max-num-tokens"),
        max_seq_len=build.max_seq_len, block_size=build.kv_block_size, num_kv_blocks=options.num_kv_blocks,
        enable_prefix_caching=_prefix_caching(info, options.enable_prefix_caching, build.max_seq_len),
        kv_cache_memory_fraction=options.kv_cache_memory_fraction, cuda_graphs=options.cuda_graphs,
        kv_cache_dtype=build.kv_cache_torch_dtype, async_scheduling=options.async_scheduling,
        capacity_scheduler_policy=options.capacity_scheduler_policy, enable_lora=options.enable_lora,
        max_loras=options.max_loras, max_lora_rank=options.max_lora_rank,
        max_cpu_loras=options.max_cpu_loras if options.max_cpu_loras is not None else 2 * options.max_loras,
        kv_offloading_size=options.kv_offloading_size, kv_offloading_dir=_disk_tier(info, options.kv_offloading_dir),
        kv_offloading_disk_size=options.kv_offloading_disk_size)


def _disk_tier(info: EngineInfo, directory: str | None) -> str | None:
    """The disk tier's directory; refused for a tensor-parallel engine, whose ranks' host tiers live in their
    own processes (the engine's side reads and writes rank 0's slots)."""
    if directory is not None and info.config.mapping.tp_size > 1:
        raise ValueError(f"kv_offloading_dir (--kv-offloading-dir): the disk tier runs at tp_size 1 for now; this "
                         f"tensor-parallel engine (tp_size {info.config.mapping.tp_size}) keeps to the host tier "
                         f"(--kv-offloading-size)")
    return directory


def engine_quant_config(info: EngineInfo) -> QuantConfig | None:
    """The QuantConfig of the engine's weights (None for full precision), from build_config.quantization."""
    recorded = info.config.build.quantization
    if recorded is None:
        return None
    try:
        return QuantSpec.from_dict(recorded).quant_config()
    except QuantError as e:
        raise EngineError(f"{info.spec.engine_dir / 'engine.json'}: build_config.quantization: {e}; rebuild the "
                          f"engine with this kiln") from None


def load_network(info: EngineInfo, device: torch.device, rank: int = 0, comm: TPComm | None = None) -> CausalLM:
    """Rank `rank`'s network with its weights on `device`, built by the same `build_network` as the builder;
    `comm`: its tensor-parallel group's collectives (needed when the engine has several ranks)."""
    path = info.spec.rank_file(rank)
    quant = engine_quant_config(info)
    install_kernel_settings(info.spec, device)
    install_engine_kernels(info.spec, device)  # before any launch; once per engine in a process
    with torch.device("meta"):
        model = build_network(info.model_def, info.model_config, quant, info.config.mapping.for_rank(rank),
                              dtype=info.config.build.torch_dtype, comm=comm)
    if info.config.build.weights_at_load:
        draw_dummy_weights(model, seed=0, device=device)
        logger.info("drew dummy weights for rank %d on %s (the engine holds no weight files)", rank, device)
        return model.eval()
    start = time.perf_counter()
    try:  # on the CPU load_file's tensors map the file, which costs nothing at startup
        weights = read_weights(path, device) if device.type == "cuda" else load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own error types
        raise EngineError(f"cannot read {path}: {e}; rebuild the engine") from e
    logger.debug("read %s onto %s in %.2fs", path, device, time.perf_counter() - start)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        raise EngineError(f"{path} does not fit the model in engine.json: {e}") from e
    return model.eval()


def load_engine(engine_dir: str | Path, options: RuntimeOptions | None = None, /,
                **keywords) -> tuple[LoadedEngine, RuntimeConfig]:
    """Checks and loads an engine directory with rank 0's weights in this process; every failure is an
    EngineError or ValueError saying what to do. `options` / `keywords` are `resolve_runtime`'s (speculative_config
    does not apply: it needs an engine core, see engine_factory.create_engine)."""
    start = time.perf_counter()
    options = runtime_options(options, keywords, "load_engine")
    info = load_engine_info(engine_dir, verify_checksums=options.verify_checksums)
    runtime = resolve_runtime(info, options)
    model = load_network(info, runtime.device)
    logger.info("loaded engine %s (%s, %s, %s) in %.2fs", info.spec.engine_dir, info.spec.architecture,
                info.config.build.dtype, runtime.device, time.perf_counter() - start)
    return LoadedEngine(**vars(info), model=model), runtime
