"""What every Python-backend model directory of `kiln triton-repo` holds, for both layouts (repository.py,
layout_repository.py): the model.py source of the single model, the name of kiln_env.json, and the rule for
replacing a directory."""

from __future__ import annotations

from pathlib import Path

MODEL_SOURCE = Path(__file__).with_name("python_model.py")
ENV_FILE = "kiln_env.json"  # beside model.py


def check_target(target: Path, force: bool) -> None:
    """A model directory may be written at `target`: absent, empty, or (with `force`) a Triton model."""
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"{target} exists and is not a directory")
        if any(target.iterdir()):
            if not force:
                raise ValueError(f"{target} already exists; pass --force to replace it")
            if not (target / "config.pbtxt").is_file():
                raise ValueError(f"{target} is not a Triton model (it has no config.pbtxt); not replacing it "
                                 f"even with --force: remove it or pick another --model-name")
