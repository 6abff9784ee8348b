"""model.py of the ensemble layout's Python models (`kiln triton-repo --layout ensemble` copies this file to
REPO/{preprocessing,tensorrt_llm,postprocessing,tensorrt_llm_bls}/1/model.py).

Beside it, kiln_model.py is a copy of the single model's model.py (python_model.py): loading it finds kiln as
kiln_env.json says and refuses what is known to break (check_environment); this file then serves the model that
config.pbtxt's parameter kiln_model names (kiln.serve.tritonserver.layout), with that module's helpers.
"""

import importlib.util
import json
import os
import sys

_SPEC = importlib.util.spec_from_file_location(
    "kiln_triton_base", os.path.join(os.path.dirname(os.path.abspath(__file__)), "kiln_model.py"))
base = importlib.util.module_from_spec(_SPEC)
sys.modules["kiln_triton_base"] = base
_SPEC.loader.exec_module(base)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from kiln.serve.tritonserver.layout import (
            BLS,
            POSTPROCESSING,
            PREPROCESSING,
            ROLE_PARAMETER,
            TENSORRT_LLM,
        )

        config = json.loads(args["model_config"])
        values = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
        role = values.get(ROLE_PARAMETER, "")
        params = base.BackendParameters.from_strings(values)
        base.check_environment(config, params.engine_dir)
        if role in (PREPROCESSING, POSTPROCESSING):
            from kiln.serve.tritonserver.text_steps import TextStep

            self.model = TextStep(base, role)
            self.model.initialize(args, params)
            return
        if role == TENSORRT_LLM:
            from kiln.serve.tritonserver.token_model import TokenModel as Model
        elif role == BLS:
            from kiln.serve.tritonserver.bls_model import BlsModel as Model
        else:
            raise base.pb_utils.TritonModelException(f"config.pbtxt parameter {ROLE_PARAMETER}={role!r} is not a "
                                                     "model of the ensemble layout: write it with `kiln triton-repo`")
        if not base.pb_utils.using_decoupled_model_transaction_policy(config):
            raise base.pb_utils.TritonModelException(
                f"kiln's {role} streams responses: config.pbtxt needs model_transaction_policy {{ decoupled: true }}")
        self.model = Model(base)
        self.model.initialize(args, params, config)

    def execute(self, requests: list):
        return self.model.execute(requests)

    def finalize(self) -> None:
        self.model.finalize()
