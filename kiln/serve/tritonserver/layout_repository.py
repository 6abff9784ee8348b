"""`kiln triton-repo --layout ensemble`: writes TensorRT-LLM backend's five models (layout.py) into REPO.

    REPO/ensemble/config.pbtxt + REPO/ensemble/1/     Triton's ensemble scheduling (no code)
    REPO/<python model>/config.pbtxt                  python backend, the tensors of layout.model_tensors, the
                                                      BackendParameters and kiln_model (which model it is)
    REPO/<python model>/1/model.py                    a copy of layout_shim.py
    REPO/<python model>/1/kiln_model.py               a copy of python_model.py (finds and checks kiln)
    REPO/<python model>/1/kiln_env.json               as the single model's (repository.py)

Only tensorrt_llm loads the engine, on the engine's device kind; preprocessing, postprocessing and
tensorrt_llm_bls run on the CPU with the engine's tokenizer (or nothing of it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.engine_format.staging import staged_directory
from kiln.serve.tritonserver.layout import ENSEMBLE, MODEL_NAMES, ROLE_PARAMETER, TENSORRT_LLM, layout_config
from kiln.serve.tritonserver.model_files import ENV_FILE, MODEL_SOURCE, check_target

SHIM_SOURCE = Path(__file__).with_name("layout_shim.py")
BASE_FILE = "kiln_model.py"  # beside model.py: the single model's model.py, which the shim loads first


def write_layout(repo: Path, max_batch_size: int, kind: str, parameters: dict[str, str], recorded: dict,
                 force: bool) -> list[Path]:
    """Writes the five models (in layout.MODEL_NAMES' order) after checking every target may be written;
    `parameters`: BackendParameters.to_strings(), for every Python model's config.pbtxt."""
    targets = [repo / name for name in MODEL_NAMES]
    for target in targets:
        check_target(target, force)
    for name, target in zip(MODEL_NAMES, targets):
        with staged_directory(target) as staging:
            (staging / "config.pbtxt").write_text(config_text(name, max_batch_size, kind, parameters))
            (staging / "1").mkdir()
            if name == ENSEMBLE:
                continue
            shutil.copyfile(SHIM_SOURCE, staging / "1" / "model.py")
            shutil.copyfile(MODEL_SOURCE, staging / "1" / BASE_FILE)
            (staging / "1" / ENV_FILE).write_text(json.dumps(recorded, indent=2) + "\n")
    return targets


def config_text(name: str, max_batch_size: int, kind: str, parameters: dict[str, str]) -> str:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = layout_config(name, max_batch_size, None if name == ENSEMBLE else {**parameters, ROLE_PARAMETER: name})
    if name != ENSEMBLE:
        instance = kind if name == TENSORRT_LLM else "KIND_CPU"
        config.instance_group.append(mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.Kind.Value(instance), count=1))
    return (f"# written by `kiln triton-repo --layout ensemble` for the engine {parameters['engine_dir']}\n"
            + text_format.MessageToString(config))
