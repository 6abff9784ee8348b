"""`kiln build`: checkpoint -> engine directory.

load config -> network on meta (names, shapes, dtypes) -> weight recipes (map names, fuse qkv and gate_up)
-> cast -> (quantize) -> cut each whole tensor into every rank's share (sharding.py) -> write
rank0..rank{N-1}.safetensors (streamed in one pass: one whole tensor and one cut of it in memory at a time)
-> copy tokenizer -> engine.json with the manifest. The engine is built in a temporary directory next to
the output and moved into place at the end, so a failed build never leaves something that looks like an
engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.checkpoints.prequant.detect import detect_checkpoint_quantization
from kiln.checkpoints.reader import CheckpointError, CheckpointReader
from kiln.engine_format import (
    ENGINE_DTYPES,
    ENGINE_JSON,
    QUANTIZED_FORMAT_VERSION,
    EngineBuildConfig,
    FileEntry,
    Mapping,
    file_entry,
    rank_file_name,
    write_engine_json,
)
from kiln.engine_format.chunks import DEFAULT_CHUNK_BYTES
from kiln.engine_format.limits import check_build_limits
from kiln.engine_format.ownership import engine_manifest_paths, foreign_entries
from kiln.engine_format.staging import staged_directory
from kiln.model_defs import ModelConfig, ModelDef, build_network, model_def_for_hf_config
from kiln.model_defs.config import token_id_list
from kiln.model_defs.recipes import Recipe, consumed_parts
from kiln.quant.base import QuantConfig, QuantError

from .build_config import BuildConfig
from .dummy_weights import dummy_tensor
from .finite_check import finite_reader
from .kernel_store import KernelStoreError, with_stored_kernels
from .quantize import (
    QuantPlan,
    checkpoint_tensors,
    kv_cache_scales,
    plan_quantization,
    quant_spec,
    read_checkpoint_kv_cache,
    recipe_specs,
    run_calibration,
)
from .quantize import producer as quant_producer
from .safetensors_writer import TensorSpec, specs_of, write_safetensors_split
from .sharding import ShardingError, plan_sharding

logger = logging.getLogger("kiln.builder")
# Weight files longer than this also list their chunks' sha256s, so a load verifies them on every core.
WEIGHT_CHUNK_BYTES = DEFAULT_CHUNK_BYTES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


class BuildError(Exception):
    """A build that cannot proceed; the message names the file, tensor or setting."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BuildError(f"{what} {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise BuildError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise BuildError(f"{what} {path} must hold a JSON object")
    return data


def load_model_config(checkpoint: Path) -> tuple[ModelDef, ModelConfig]:
    """The checkpoint's config.json (+ generation_config.json's EOS ids) as a ModelConfig, its values checked
    against kiln's bounds (model_defs/config_limits.py) before anything is sized by them."""
    raw = read_json(checkpoint / "config.json", "config")
    try:
        model_def = model_def_for_hf_config(raw)
        config = model_def.parse_config(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise BuildError(f"{checkpoint / 'config.json'}: {e}") from e
    gen_path = checkpoint / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path, "generation config")
        try:  # replace() checks again: an id outside the vocabulary is this file's
            if gen.get("eos_token_id") is not None:
                config = dataclasses.replace(config, eos_token_ids=token_id_list(gen["eos_token_id"]))
            if gen.get("bos_token_id") is not None:
                config = dataclasses.replace(config, bos_token_id=gen["bos_token_id"])
        except (ValueError, TypeError) as e:
            raise BuildError(f"{gen_path}: {e}") from None
    return model_def, config


# CPU flags (/proc/cpuinfo) that mean native arithmetic for a 16-bit dtype: without one, every product
# converts to float32 and back, and float32 runs faster.
_CPU_FLAGS_FOR = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where /proc/cpuinfo cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def resolve_dtype(requested: str, config: ModelConfig, device: str = "cpu",
                  flags: frozenset[str] | None = None) -> str:
    """The engine dtype for `--dtype requested`. `auto` is the checkpoint's dtype (float32 when it names
    none), except that a CPU engine of a bfloat16/float16 checkpoint is float32 unless the CPU has native
    support for that dtype (`flags`, default: this machine's): what runs faster there. Logs the choice."""
    if requested != "auto":
        return requested
    checkpoint = config.torch_dtype if config.torch_dtype in ENGINE_DTYPES else None
    chosen, why = checkpoint or "float32", "the checkpoint's dtype" if checkpoint else "the checkpoint names none"
    if device == "cpu" and chosen in _CPU_FLAGS_FOR:
        flags = cpu_flags() if flags is None else flags
        native = sorted(flags.intersection(_CPU_FLAGS_FOR[chosen]))
        if native:
            why = f"the checkpoint's dtype; this CPU computes it natively ({', '.join(native)})"
        else:
            chosen, why = "float32", (f"the checkpoint is {checkpoint} but this CPU lacks native {checkpoint} "
                                      f"({' / '.join(_CPU_FLAGS_FOR[checkpoint])}), so float32 runs faster")
    logger.info("--dtype auto for %s: %s (%s)", device, chosen, why)
    return chosen


def target_of(device: str) -> dict[str, Any]:
    target: dict[str, Any] = {"device_type": device, "gpu_name": None, "compute_capability": None,
                              "torch_version": torch.__version__, "triton_version": None, "kernel_settings": {},
                              "host": platform.machine()}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise BuildError("--device cuda was asked for but no CUDA device is available")
        target["gpu_name"] = torch.cuda.get_device_name()
        target["compute_capability"] = list(torch.cuda.get_device_capability())
        try:
            import triton

            target["triton_version"] = triton.__version__
        except ImportError:
            pass
    return target


def param_specs(model_def: ModelDef, config: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None = None,
                mapping: Mapping | None = None) -> list[TensorSpec]:
    """Name, dtype and shape of every engine tensor, in the network's order, from the network built on
    the meta device: `dtype` for unquantized tensors, whatever the linear methods declare for the rest."""
    with torch.device("meta"):
        model = build_network(model_def, config, quant, mapping, dtype=dtype)
    return specs_of(model.state_dict())


def checkpoint_producer(reader: CheckpointReader, model_def: ModelDef, config: ModelConfig,
                        specs: list[TensorSpec], read: Callable[[str], torch.Tensor] | None = None,
                        also_used: set[str] = frozenset()) -> Callable[[TensorSpec], torch.Tensor]:
    """Checks up front that every recipe's parts exist and combine to the engine tensor's shape, then
    returns a function that makes and casts one engine tensor at a time. `read` replaces reader.get as
    the source of the parts' values (the weights as calibration left them); `also_used` are checkpoint
    tensors read otherwise (a pre-quantized format's), not reported as unused."""
    recipes = check_checkpoint_shapes(reader, model_def, config, specs)
    used = consumed_parts(recipes[s.name] for s in specs) | also_used
    unused = [n for n in reader.names() if n not in used and not n.endswith("rotary_emb.inv_freq")]
    if unused:
        logger.warning("checkpoint has %d tensors the model does not use (config.json may not match the "
                       "weights), e.g. %s", len(unused), ", ".join(unused[:3]))

    read = read or reader.get

    def produce(spec: TensorSpec) -> torch.Tensor:
        return recipes[spec.name].make(spec.name, read).to(spec.dtype)

    return produce


def check_checkpoint_shapes(reader: CheckpointReader, model_def: ModelDef, config: ModelConfig,
                            specs: list[TensorSpec]) -> dict[str, Recipe]:
    """The recipes of `specs`, once every part is found in the checkpoint and they combine to the engine
    tensor's shape (read from the file headers, no weights loaded); a BuildError names the first that does not."""
    recipes = model_def.recipes(config, [s.name for s in specs])
    missing = [part for s in specs for part in recipes[s.name].parts if part not in reader]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise BuildError(f"checkpoint {reader.checkpoint_dir} lacks tensors the model needs: {shown}")
    for s in specs:
        recipe = recipes[s.name]
        shapes = [reader.shape(part) for part in recipe.parts]
        dtypes = [reader.dtype(part) for part in recipe.parts]
        if recipe.expected_shape(s.name, shapes, dtypes) != s.shape:
            raise BuildError(
                f"checkpoint tensor(s) {recipe.parts} have shapes {shapes}, but config.json implies "
                f"{s.name} of shape {list(s.shape)}; does config.json belong to these weights?"
            )
    return recipes


def copy_tokenizer(checkpoint: Path, engine: Path) -> dict[str, FileEntry]:
    present = [name for name in TOKENIZER_FILES if (checkpoint / name).is_file()]
    if not any(n in present for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        logger.warning("checkpoint %s has no tokenizer files: the engine will accept token ids only", checkpoint)
        return {}
    (engine / "tokenizer").mkdir()
    files = {}
    for name in present:
        shutil.copy2(checkpoint / name, engine / "tokenizer" / name)
        files[f"tokenizer/{name}"] = file_entry(engine / "tokenizer" / name)
    return files


def _check_output(output: Path) -> None:
    """Refuses an output that is not a directory, or a non-empty directory other than a kiln engine: a
    build replaces the whole output, and must never delete someone's files because one is named engine.json."""
    if output.exists() and not output.is_dir():
        raise BuildError(f"output {output} exists and is not a directory")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if not (output / ENGINE_JSON).exists():
        raise BuildError(f"output {output} is a non-empty directory that is not an engine; choose another")
    try:
        foreign = foreign_entries(output, engine_manifest_paths(output))
    except ValueError as e:
        raise BuildError(f"output {output} has an {ENGINE_JSON} that is not a kiln engine's ({e}); choose another "
                         f"--output") from None
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise BuildError(f"output {output} holds files that are not part of a kiln engine ({shown}); choose another "
                         f"--output or remove them")


def _producer(config: BuildConfig, reader: CheckpointReader | None, model_def: ModelDef, model_config: ModelConfig,
              float_specs: list[TensorSpec], plan: QuantPlan | None) -> tuple[Callable[[TensorSpec], torch.Tensor], str]:
    """The writer's producer of whole (tp_size 1) tensors and the progress label's kind of weights (`reader`
    is None for dummy weights)."""
    by_name = {s.name: s for s in float_specs}
    if reader is None:
        float_produce = lambda spec: dummy_tensor(spec, config.seed, config.device)  # noqa: E731
        kind, read = " (dummy)", None
    else:
        calibrated = None if plan is None or plan.result is None else plan.result.state
        get = finite_reader(reader.get, reader.checkpoint_dir, allow=config.allow_non_finite)
        read = get if calibrated is None else (lambda name: calibrated[name] if name in calibrated else get(name))
        checked, also_used = float_specs, set()
        if plan is not None and plan.checkpoint_format is not None:
            # The quantized layers' weights are read by the format, as the tensors it names.
            replaced, also_used = checkpoint_tensors(plan, model_def, model_config)
            checked = [s for s in float_specs if s.name not in replaced]
            read_checkpoint_kv_cache(plan, reader.get, set(reader.names()), model_config.num_layers)
        float_produce = checkpoint_producer(reader, model_def, model_config, checked, read, also_used)
        kind = "" if plan is None else f" ({quant_spec(plan).qformat})"
    if plan is None:
        produce = float_produce
    else:
        quantized = quant_producer(plan, model_def, model_config, lambda name: float_produce(by_name[name]), read,
                                   set() if reader is None else set(reader.names()))
        produce = lambda spec: quantized(spec.name, spec.dtype, spec.shape)  # noqa: E731
    return produce, kind


def _kernel_settings(config: BuildConfig, model_def: ModelDef, model_config: ModelConfig, dtype: torch.dtype,
                     quant: QuantConfig | None, mapping: Mapping) -> dict[str, Any]:
    """target.kernel_settings: the tunable kernels' winners timed on this GPU (device cuda with tune), else {}.
    Every rank of a tensor-parallel engine has rank 0's shapes."""
    from kiln.plugins._triton import USE_TRITON

    if config.device != "cuda" or not config.tune or not USE_TRITON:
        return {}
    from .tune import tune_kernels

    with torch.device("meta"):
        network = build_network(model_def, model_config, quant, dataclasses.replace(mapping, tp_rank=0),
                                dtype=dtype)
    return tune_kernels(network, dtype, torch.device("cuda", torch.cuda.current_device()))


def build_engine(checkpoint_dir: str | Path, output_dir: str | Path, config: BuildConfig | None = None,
                 *, progress: bool = True) -> Path:
    """Builds an engine from a Hugging Face checkpoint directory; returns the engine directory."""
    start = time.perf_counter()
    config = config or BuildConfig()
    # Resolved so the staging directory sits next to the real output even for `--output .` or a symlink;
    # unresolved, "." would stage inside itself and a symlink could not be replaced.
    checkpoint, output = Path(checkpoint_dir), Path(output_dir).resolve()
    if not checkpoint.is_dir():
        raise BuildError(f"checkpoint directory {checkpoint} does not exist")
    model_def, model_config = load_model_config(checkpoint)
    if config.device == "cuda" and model_def.cuda_refusal:
        raise BuildError(model_def.cuda_refusal)
    dtype_name = resolve_dtype(config.dtype, model_config, config.device)
    max_seq_len = config.max_seq_len or model_config.max_position_embeddings
    try:  # again with max_seq_len resolved: the block tables of a full batch must stay allocatable
        check_build_limits(max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens,
                           max_seq_len=max_seq_len, kv_block_size=config.kv_block_size)
    except ValueError as e:
        default = "" if config.max_seq_len else (f" (max_seq_len defaults to {checkpoint / 'config.json'}'s "
                                                 f"max_position_embeddings; pass --max-seq-len)")
        raise BuildError(f"{e}{default}") from None
    if max_seq_len > model_config.max_position_embeddings:
        logger.warning("max_seq_len %d exceeds the model's max_position_embeddings %d: quality past the "
                       "trained context depends on its rope scaling", max_seq_len,
                       model_config.max_position_embeddings)
    target = target_of(config.device)
    torch_dtype = ENGINE_DTYPES[dtype_name]
    with contextlib.ExitStack() as stack:
        try:
            # Opened before anything is written: its shard headers name the tensors, which say whether the
            # checkpoint is already quantized (and fail on a corrupt shard or a wrong index).
            reader = None if config.dummy_weights else CheckpointReader(checkpoint)
            if reader is not None:
                stack.callback(reader.close)
            checkpoint_format = None if reader is None else detect_checkpoint_quantization(
                checkpoint, read_json(checkpoint / "config.json", "config"), reader.names())
            plan = plan_quantization(config, model_def, model_config, torch_dtype, checkpoint_format)
        except CheckpointError as e:
            raise BuildError(str(e)) from e
        except QuantError as e:
            raise BuildError(str(e)) from None
        float_specs = param_specs(model_def, model_config, torch_dtype)
        specs = float_specs if plan is None else param_specs(model_def, model_config, torch_dtype, plan.quant)
        mapping = Mapping(tp_size=config.tp_size)
        try:  # every rank's network, before anything is written: heads or groups that do not split fail here
            sharder = plan_sharding(model_def, model_config, None if plan is None else plan.quant, mapping, specs,
                                    dtype=torch_dtype)
        except ShardingError as e:
            raise BuildError(str(e)) from None
        if reader is not None and plan is not None and plan.calibrate and plan.checkpoint_format is None:
            # Calibration loads the whole model: a config that does not fit the weights fails before that.
            check_checkpoint_shapes(reader, model_def, model_config, float_specs)

        _check_output(output)
        staging = stack.enter_context(staged_directory(output, check_replace=_check_output))
        try:
            if plan is not None:
                run_calibration(plan, checkpoint, model_config)
            produce, kind = _producer(config, reader, model_def, model_config, recipe_specs(plan, float_specs, specs), plan)
            ranks = range(0 if config.weights_at_load else mapping.num_ranks)  # drawn at load: no weight files
            label = "rank0" if mapping.num_ranks == 1 else f"rank0..rank{mapping.num_ranks - 1}"
            written = write_safetensors_split(
                [staging / rank_file_name(r) for r in ranks], specs, sharder.rank_specs[:len(ranks)], produce,
                sharder.cut, [{"format": "pt", "kiln_rank": str(r)} for r in ranks], progress=progress,
                desc=f"writing {label}{kind}", chunk_bytes=WEIGHT_CHUNK_BYTES) if ranks else []
        except CheckpointError as e:
            raise BuildError(str(e)) from e
        except QuantError as e:
            raise BuildError(str(e)) from None
        target["kernel_settings"] = _kernel_settings(config, model_def, model_config, torch_dtype,
                                                     None if plan is None else plan.quant, mapping)
        files = {**{rank_file_name(r): FileEntry(w.size, w.sha256, w.chunk_bytes, w.chunk_sha256)
                    for r, w in enumerate(written)},
                 **copy_tokenizer(checkpoint, staging)}
        build = EngineBuildConfig(
            dtype=dtype_name, max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens,
            max_seq_len=max_seq_len, kv_block_size=config.kv_block_size,
            kv_cache_dtype=dtype_name if plan is None or not plan.kv_quantized else plan.kv_cache_dtype,
            kv_cache_scales=None if plan is None else kv_cache_scales(plan, model_config.num_layers),
            quantization=None if plan is None else quant_spec(plan).to_dict(), dummy_weights=config.dummy_weights,
            weights_at_load=config.weights_at_load, max_beam_width=config.max_beam_width)
        fields = dict(architecture=model_config.architecture, model_config=model_config.to_dict(),
                      build_config=build.to_dict(), mapping=mapping.to_dict(), target=target, files=files,
                      kiln_version=kiln.__version__, format_version=1 if plan is None else QUANTIZED_FORMAT_VERSION)
        write_engine_json(staging, **fields)
        if config.kernels:  # compiled by starting the finished engine in a child process, then listed
            try:
                write_engine_json(staging, **with_stored_kernels(staging, fields))
            except KernelStoreError as e:
                raise BuildError(str(e)) from None
    logger.info("built %s (%s, %s) in %.1fs", output, model_config.architecture, dtype_name,
                time.perf_counter() - start)
    return output
