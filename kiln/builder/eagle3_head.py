"""`kiln build --checkpoint HEAD_DIR --speculative-target TARGET_ENGINE`: an EAGLE-3 head (the published
layout) into a head engine for one target engine.

The head is checked against the target (hidden size, vocabulary), its q/k/v and gate/up fused and `d2t` turned
into target ids (`model_defs.eagle3_head.head_state`), cast to the engine dtype (default: the target's) and
written as rank0.safetensors; engine.json holds the head's config as model_config and, in build_config, the
dtype and the target it was built for (`engine_format.speculative_target`), so a load with another target warns
naming both. Written through a staging directory like any engine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from safetensors.torch import save_file

import kiln
from kiln.checkpoints.reader import CheckpointError, CheckpointReader
from kiln.engine_format import (
    ENGINE_DTYPES,
    EngineError,
    file_entry,
    load_engine_spec,
    rank_file_name,
    write_engine_json,
)
from kiln.engine_format.speculative_target import SPECULATIVE_TARGET, target_record
from kiln.engine_format.staging import staged_directory
from kiln.model_defs.eagle3_head import check_head, head_state, is_head_config, parse_head_config

from .build import BuildError, _check_output, read_json

logger = logging.getLogger("kiln.builder")
TARGET_FLAG = "--speculative-target"


def is_head_checkpoint(checkpoint: str | Path) -> bool:
    """Whether `checkpoint`'s config.json names an EAGLE-3 head (False when it has none: the build says why)."""
    path = Path(checkpoint) / "config.json"
    return path.is_file() and is_head_config(read_json(path, "config"))


def build_head_engine(checkpoint_dir: str | Path, output_dir: str | Path, target_engine: str | Path | None,
                      dtype: str = "auto") -> Path:
    """Builds the EAGLE-3 head in `checkpoint_dir` into a head engine at `output_dir` for `target_engine` (a kiln
    engine directory); `dtype` "auto" is the target's. BuildError names the flag, directory or value at fault."""
    start = time.perf_counter()
    checkpoint, output = Path(checkpoint_dir), Path(output_dir).resolve()
    raw = read_json(checkpoint / "config.json", "config")
    if not is_head_config(raw):
        raise BuildError(f"{TARGET_FLAG} builds an EAGLE-3 head; {checkpoint / 'config.json'} names "
                         f"{(raw.get('architectures') or ['?'])[0]!r}, not LlamaForCausalLMEagle3")
    if target_engine is None:
        raise BuildError(f"checkpoint {checkpoint} is an EAGLE-3 head ({raw['architectures'][0]}): it drafts for one "
                         f"target model, so name the target's kiln engine with {TARGET_FLAG} TARGET_ENGINE")
    try:
        target = load_engine_spec(target_engine, verify_checksums=False)
        config = parse_head_config(raw, f"EAGLE-3 head {checkpoint}")
        check_head(str(checkpoint), config, int(target.model_config["hidden_size"]),
                   int(target.model_config["vocab_size"]), f"the target engine {target_engine}")
    except EngineError as e:
        raise BuildError(f"{TARGET_FLAG} {target_engine}: {e}") from None
    dtype_name = target.build_config.get("dtype", "float32") if dtype == "auto" else dtype
    if dtype_name not in ENGINE_DTYPES:
        raise BuildError(f"--dtype {dtype_name!r} must be one of {', '.join(ENGINE_DTYPES)}")
    try:
        reader = CheckpointReader(checkpoint)
        try:
            tensors = {name: reader.get(name) for name in reader.names()}
        finally:
            reader.close()
        state = head_state(str(checkpoint), config, tensors)
    except (CheckpointError, EngineError) as e:
        raise BuildError(str(e)) from None
    # Weights and norms in the engine dtype; draft_to_target stays int64 (target ids).
    state = {k: (v if k == "draft_to_target" else v.to(ENGINE_DTYPES[dtype_name])).contiguous()
             for k, v in state.items()}
    _check_output(output)
    with staged_directory(output, check_replace=_check_output) as staging:
        weights = staging / rank_file_name(0)
        save_file(state, str(weights), metadata={"format": "pt", "kiln_rank": "0"})
        write_engine_json(staging, architecture=raw["architectures"][0], model_config=raw,
                          build_config={"dtype": dtype_name, SPECULATIVE_TARGET: target_record(target)},
                          mapping={"tp_size": 1, "num_ranks": 1}, target=dict(target.target),
                          files={rank_file_name(0): file_entry(weights)}, kiln_version=kiln.__version__)
    logger.info("built EAGLE-3 head engine %s (%s) for the target engine %s in %.1fs", output, dtype_name,
                target_engine, time.perf_counter() - start)
    return output


__all__ = ["TARGET_FLAG", "build_head_engine", "is_head_checkpoint"]
