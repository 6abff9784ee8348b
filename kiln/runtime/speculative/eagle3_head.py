"""Reading an EAGLE-3 head for the proposer: from a checkpoint in the published layout (config.json +
safetensors or .bin), or from a head engine `kiln build --checkpoint HEAD_DIR --speculative-target TARGET` wrote
(engine.json with the head's config and the target it was built for, rank0.safetensors with the module's
tensors; every file checked against the manifest like any engine's). The architecture itself (config, module,
the published tensors' mapping) is `kiln.model_defs.eagle3_head`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.checkpoints.reader import CheckpointError, CheckpointReader
from kiln.engine_format import ENGINE_JSON, EngineError, EngineSpec, load_engine_spec
from kiln.engine_format.speculative_target import SPECULATIVE_TARGET, target_identity
from kiln.model_defs import ModelConfig
from kiln.model_defs.eagle3_head import (
    ARCHITECTURES,
    Eagle3Head,
    Eagle3HeadConfig,
    check_head,
    check_state,
    head_module,
    head_state,
    parse_head_config,
)

__all__ = ["ARCHITECTURES", "Eagle3Head", "Eagle3HeadConfig", "head_feature_layers", "load_head", "read_head_config"]

logger = logging.getLogger("kiln.runtime")


def read_head_config(head_dir: Path) -> Eagle3HeadConfig:
    """A head checkpoint's config.json; an EngineError names the directory and the field at fault."""
    try:
        raw = json.loads((head_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"--speculative-model {head_dir}: no readable EAGLE-3 config.json ({e})") from None
    return parse_head_config(raw, f"--speculative-model {head_dir}")


def head_feature_layers(head_dir: str | Path, target_layers: int) -> tuple[int, ...]:
    """The target layers a head reads, from its config alone (a checkpoint's config.json or a head engine's
    engine.json), before anything loads: the target's runner captures its graphs keeping them."""
    head_dir = Path(head_dir)
    if (head_dir / ENGINE_JSON).is_file():
        spec = load_engine_spec(head_dir, verify_checksums=False)
        config = parse_head_config(spec.model_config, f"--speculative-model {head_dir}")
    else:
        config = read_head_config(head_dir)
    return config.feature_layers(target_layers)


def _checkpoint_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    try:
        reader = CheckpointReader(head_dir)
        try:
            return {name: reader.get(name) for name in reader.names()}
        finally:
            reader.close()
    except CheckpointError as e:
        raise EngineError(f"--speculative-model {head_dir}: {e}") from None


def _engine_head(head_dir: Path, target_spec: EngineSpec | None,
                 verify_checksums: bool) -> tuple[Eagle3HeadConfig, dict[str, torch.Tensor]]:
    """A head engine's config and tensors (the module's names), its files verified against its manifest; warns,
    naming both, when it was built for another target engine than `target_spec`."""
    spec = load_engine_spec(head_dir, verify_checksums=verify_checksums)
    where = f"--speculative-model {head_dir}"
    if spec.architecture not in ARCHITECTURES:
        raise EngineError(f"{where}: engine architecture {spec.architecture!r} is not an EAGLE-3 head's; a model "
                          f"engine drafts with --speculative-mode draft_model")
    config = parse_head_config(spec.model_config, where)
    built_for = spec.build_config.get(SPECULATIVE_TARGET) or {}
    if target_spec is not None and built_for.get("identity") != target_identity(target_spec):
        logger.warning("EAGLE-3 head engine %s was built for the target engine %s, not for %s (another model, "
                       "weights or dtype): its drafts may be poor; rebuild it with --speculative-target %s",
                       head_dir, built_for.get("engine", "(unrecorded)"), target_spec.engine_dir,
                       target_spec.engine_dir)
    state = load_file(str(spec.rank_file(0)))
    check_state(str(head_dir), config, state)
    return config, state


def load_head(head_dir: str | Path, target: ModelConfig, target_embedding: torch.Tensor, *,
              target_spec: EngineSpec | None = None, verify_checksums: bool = True) -> Eagle3Head:
    """The head in `head_dir` (a checkpoint, or a head engine: it has engine.json) on the target embedding's
    device and dtype; `target_embedding` [V, H] is shared when the head has no embedding of its own. An
    EngineError names a missing tensor, a mismatched shape, a file that fails its manifest, or a head trained
    for another target."""
    head_dir = Path(head_dir)
    if (head_dir / ENGINE_JSON).is_file():
        config, state = _engine_head(head_dir, target_spec, verify_checksums)
        check_head(str(head_dir), config, target.hidden_size, target.vocab_size)
    else:
        config = read_head_config(head_dir)
        check_head(str(head_dir), config, target.hidden_size, target.vocab_size)
        state = head_state(str(head_dir), config, _checkpoint_tensors(head_dir))
    return head_module(config, state, target_embedding)
