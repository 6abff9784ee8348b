"""A Triton Inference Server model repository that serves a kiln engine through Triton's Python backend.

    REPO/NAME/config.pbtxt   python backend, decoupled, the tensors of triton_schema, one instance on the
                             engine's device kind, and the BackendParameters below
    REPO/NAME/1/model.py     a copy of kiln/serve/tritonserver/python_model.py; it imports kiln
    REPO/NAME/1/kiln_env.json  where model.py finds kiln: `python_path`, directories it adds to the front of
                             the backend interpreter's sys.path before importing numpy and kiln (the
                             --python-path directories, then the site directories of the Python that wrote
                             the repository, .pth files included), `kiln_version`, the kiln that wrote it,
                             and `kiln_dir`, its package directory, which model.py imports kiln from

`tritonserver --model-repository REPO` then serves the engine under NAME.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import site
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.engine_format import load_engine_spec
from kiln.engine_format.staging import staged_directory
from kiln.runtime.speculative import SpeculativeConfig, speculative_config_of
from kiln.serve.tritonserver.model_files import ENV_FILE, MODEL_SOURCE, check_target

SCHEDULER_POLICIES = ("max_utilization", "guaranteed_no_evict")
LAYOUTS = ("single", "ensemble")  # one model, or TensorRT-LLM backend's five (layout.py)
# Triton takes the model's directory name as its name; keep it to characters every URL and file system takes.
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_BOOLS = {"true": True, "false": False}
_LORA_LIMITS = ("max_loras", "max_lora_rank", "max_cpu_loras")
_OFFLOADING = ("kv_cache_host_memory_bytes", "kv_offloading_dir", "kv_offloading_disk_size")


@dataclass(frozen=True)
class BackendParameters:
    """What model.py reads from config.pbtxt's `parameters` (Triton hands every value over as a string).

    Names and meanings follow TensorRT-LLM's Triton backend: `enable_kv_cache_reuse` is kiln's prefix cache;
    `kv_cache_free_gpu_mem_fraction` is the share of the memory left free after the weights and one step's
    activations that the KV cache takes (the runtime's kv_cache_memory_fraction);
    `batch_scheduler_policy` says when a request may enter the running batch (RuntimeOptions.capacity_scheduler_policy, runtime/core/capacity.py).
    `max_prompt_chars` is kiln's (kiln serve's --max-prompt-chars): the characters one text_input may hold,
    checked before it is tokenized (absent: serve/limits.py's default_max_prompt_chars for the engine).
    `enable_lora`, `max_loras`, `max_lora_rank` and `max_cpu_loras` are the runtime's LoRA options (RuntimeOptions;
    absent: its defaults): with enable_lora the inputs lora_task_id, lora_weights and lora_config select adapters.
    `kv_cache_host_memory_bytes` is TensorRT-LLM's host cache for block reuse: the bytes of host memory the prefix
    cache's evicted blocks move to (the runtime's kv_offloading_size, in GiB); `kv_offloading_dir` and
    `kv_offloading_disk_size` (GiB) are kiln's disk tier below it (RuntimeOptions; absent: off, and its default).
    `speculative_config` is kiln's: speculative decoding as `LLM(speculative_config=...)` takes it, a JSON object
    (vLLM's keys: method, model (an absolute path), num_speculative_tokens, ...; absent: off).
    """

    engine_dir: str  # absolute path
    batch_scheduler_policy: str = "max_utilization"
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True
    max_prompt_chars: int | None = None
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    kv_cache_host_memory_bytes: int | None = None
    kv_offloading_dir: str | None = None
    kv_offloading_disk_size: float | None = None
    speculative_config: str | None = None  # a JSON object

    def __post_init__(self) -> None:
        if not Path(self.engine_dir).is_absolute():
            raise ValueError(f"engine_dir={self.engine_dir!r} must be an absolute path")
        if self.batch_scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"batch_scheduler_policy={self.batch_scheduler_policy!r} must be one of "
                             f"{', '.join(SCHEDULER_POLICIES)}")
        fraction = self.kv_cache_free_gpu_mem_fraction
        if not (isinstance(fraction, float) and math.isfinite(fraction) and 0 < fraction <= 1):
            raise ValueError(f"kv_cache_free_gpu_mem_fraction={fraction!r} must be a number in (0, 1]")
        if not isinstance(self.enable_kv_cache_reuse, bool):
            raise ValueError(f"enable_kv_cache_reuse={self.enable_kv_cache_reuse!r} must be true or false")
        for name in ("max_prompt_chars", *_LORA_LIMITS):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        host = self.kv_cache_host_memory_bytes
        if host is not None and (isinstance(host, bool) or not isinstance(host, int) or host < 0):
            raise ValueError(f"kv_cache_host_memory_bytes={host!r} must be a number of bytes, at least 0")
        if self.kv_offloading_dir is not None and not host:
            raise ValueError(f"kv_offloading_dir={self.kv_offloading_dir!r} needs kv_cache_host_memory_bytes > 0 "
                             f"(--kv-cache-host-memory-bytes): the disk tier holds what the host memory evicts")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora={self.enable_lora!r} must be true or false")
        if self.speculative_config is not None:
            self.speculative_options()  # a ValueError names what is wrong with it

    def speculative_options(self) -> dict:
        """The RuntimeOptions field of speculative decoding that config.pbtxt sets ({} for none)."""
        if self.speculative_config is None:
            return {}
        try:
            fields = json.loads(self.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config={self.speculative_config!r} is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"speculative_config={self.speculative_config!r} must be a JSON object, e.g. "
                             f'{{"method": "ngram", "num_speculative_tokens": 4}}')
        config = SpeculativeConfig.from_dict(fields)  # ValueError: an unknown key or a bad value, by name
        if config.model is not None and not Path(config.model).is_absolute():
            raise ValueError(f"speculative_config's model {config.model!r} must be an absolute path")
        return {"speculative_config": config}

    def lora_options(self) -> dict:
        """The RuntimeOptions fields of LoRA that config.pbtxt sets (the others keep the runtime's defaults)."""
        options = {name: getattr(self, name) for name in _LORA_LIMITS if getattr(self, name) is not None}
        return {"enable_lora": self.enable_lora, **options}

    def offloading_options(self) -> dict:
        """The RuntimeOptions fields of the prefix cache's host and disk tiers that config.pbtxt sets."""
        options: dict = {}
        if self.kv_cache_host_memory_bytes is not None:
            options["kv_offloading_size"] = self.kv_cache_host_memory_bytes / 2**30
        for name in ("kv_offloading_dir", "kv_offloading_disk_size"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    def to_strings(self) -> dict[str, str]:
        strings = {"engine_dir": self.engine_dir, "batch_scheduler_policy": self.batch_scheduler_policy,
                   "kv_cache_free_gpu_mem_fraction": repr(self.kv_cache_free_gpu_mem_fraction),
                   "enable_kv_cache_reuse": str(self.enable_kv_cache_reuse).lower()}
        for name in ("max_prompt_chars", *_LORA_LIMITS, *_OFFLOADING):
            if getattr(self, name) is not None:
                strings[name] = str(getattr(self, name))
        if self.enable_lora:
            strings["enable_lora"] = "true"
        if self.speculative_config is not None:
            strings["speculative_config"] = self.speculative_config
        return strings

    @classmethod
    def from_strings(cls, values: Mapping[str, str]) -> BackendParameters:
        """Parses config.pbtxt's parameters; others (e.g. the Python backend's EXECUTION_ENV_PATH) are ignored."""
        if "engine_dir" not in values:
            raise ValueError("config.pbtxt has no parameter engine_dir; write the model with `kiln triton-repo`")
        kwargs: dict = {"engine_dir": values["engine_dir"]}
        if "batch_scheduler_policy" in values:
            kwargs["batch_scheduler_policy"] = values["batch_scheduler_policy"]
        if "kv_cache_free_gpu_mem_fraction" in values:
            text = values["kv_cache_free_gpu_mem_fraction"]
            try:
                kwargs["kv_cache_free_gpu_mem_fraction"] = float(text)
            except ValueError:
                raise ValueError(f"kv_cache_free_gpu_mem_fraction={text!r} must be a number in (0, 1]") from None
        if "enable_kv_cache_reuse" in values:
            text = values["enable_kv_cache_reuse"]
            kwargs["enable_kv_cache_reuse"] = _BOOLS.get(text.strip().lower(), text)
        for name in ("max_prompt_chars", *_LORA_LIMITS):
            if values.get(name, "").strip():
                text = values[name]
                kwargs[name] = int(text) if text.strip().isdigit() else text
        if values.get("kv_cache_host_memory_bytes", "").strip():
            text = values["kv_cache_host_memory_bytes"]
            kwargs["kv_cache_host_memory_bytes"] = int(text) if text.strip().isdigit() else text
        if values.get("kv_offloading_dir", "").strip():
            kwargs["kv_offloading_dir"] = values["kv_offloading_dir"].strip()
        if values.get("kv_offloading_disk_size", "").strip():
            text = values["kv_offloading_disk_size"]
            try:
                kwargs["kv_offloading_disk_size"] = float(text)
            except ValueError:
                raise ValueError(f"kv_offloading_disk_size={text!r} must be a number of GiB above 0") from None
        if values.get("enable_lora", "").strip():
            text = values["enable_lora"]
            kwargs["enable_lora"] = _BOOLS.get(text.strip().lower(), text)
        if values.get("speculative_config", "").strip():
            kwargs["speculative_config"] = values["speculative_config"].strip()
        return cls(**kwargs)


def check_model_name(name: str) -> str:
    if not _MODEL_NAME.fullmatch(name):
        raise ValueError(f"model name {name!r} is not usable: use letters, digits, '_', '-' and '.', "
                         f"not starting with '.' or '-'")
    return name


@dataclass(frozen=True)
class TritonModel:
    """What `write_repository` wrote."""

    model_dir: Path  # REPO/NAME
    config_file: Path
    model_file: Path
    max_batch_size: int
    instance_kind: str  # KIND_CPU | KIND_GPU
    python_path: tuple[str, ...] = ()  # what kiln_env.json records
    layout_models: tuple[Path, ...] = ()  # --layout ensemble: every model directory written (model_dir's too)


def site_directories() -> list[str]:
    """The site directories of this Python (a virtual environment's included): where kiln and its
    dependencies are installed, an editable install's .pth finder included."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user:
        dirs.append(user)
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and Path(d).is_dir()]


def kiln_package_dir() -> str:
    """The directory of the kiln package that writes the repository (site-packages/kiln, or a clone's kiln/ for
    an editable install): model.py imports kiln from there, whatever folder tritonserver was started in."""
    import kiln

    return str(Path(kiln.__file__).resolve().parent)


def write_repository(engine_dir: str | Path, repo: str | Path, *, model_name: str | None = None,
                     max_batch_size: int | None = None, batch_scheduler_policy: str = "max_utilization",
                     kv_cache_free_gpu_mem_fraction: float = 0.9, enable_kv_cache_reuse: bool = True,
                     force: bool = False, python_path: Sequence[str | Path] = (),
                     record_site: bool = True, enable_lora: bool = False, max_loras: int | None = None,
                     max_lora_rank: int | None = None, max_cpu_loras: int | None = None,
                     layout: str = "single", kv_cache_host_memory_bytes: int | None = None,
                     kv_offloading_dir: str | None = None,
                     kv_offloading_disk_size: float | None = None,
                     speculative_config: SpeculativeConfig | dict | None = None) -> TritonModel:
    """Writes REPO/NAME (NAME defaults to the engine directory's name). An existing non-empty REPO/NAME is
    replaced only with `force`, and only if it is a Triton model (has a config.pbtxt). Raises EngineError
    for a directory that is not a kiln engine and ValueError for anything else it refuses.

    `python_path` (e.g. a directory with numpy<2 for Triton's Python-backend stub) and, with `record_site`,
    this Python's site directories are recorded in kiln_env.json: model.py puts them first on sys.path, and
    imports kiln from this kiln's package directory (also recorded with `record_site`). `enable_lora` and the
    LoRA limits, the prefix cache's host and disk tiers and `speculative_config` (a SpeculativeConfig or its dict; its
    model's path made absolute) go to config.pbtxt for the runtime (BackendParameters). `layout="ensemble"` writes TensorRT-LLM
    backend's five models instead (layout.py, layout_repository.py; REPO/tensorrt_llm is the model_dir returned)."""
    import kiln

    if layout not in LAYOUTS:
        raise ValueError(f"--layout {layout!r} must be one of {', '.join(LAYOUTS)}")
    if layout == "ensemble" and model_name is not None:
        raise ValueError("--model-name does not apply to --layout ensemble: its models have TensorRT-LLM's names "
                         "(preprocessing, tensorrt_llm, postprocessing, ensemble, tensorrt_llm_bls)")

    extra = []
    for entry in python_path:
        path = Path(entry).resolve()
        if not path.is_dir():
            raise ValueError(f"--python-path {entry} is not a directory")
        extra.append(str(path))
    paths = extra + (site_directories() if record_site else [])
    paths = tuple(p for i, p in enumerate(paths) if p not in paths[:i])
    spec = load_engine_spec(engine_dir, verify_checksums=False)  # only its settings are read here
    engine_dir = spec.engine_dir.resolve()
    name = check_model_name(model_name if model_name is not None else engine_dir.name)
    built = int(spec.build_config["max_batch_size"])
    if max_batch_size is None:
        max_batch_size = built
    if not 1 <= max_batch_size <= built:
        raise ValueError(f"--max-batch-size {max_batch_size} must be between 1 and the engine's built limit "
                         f"{built}")
    params = BackendParameters(str(engine_dir), batch_scheduler_policy, float(kv_cache_free_gpu_mem_fraction),
                               enable_kv_cache_reuse, enable_lora=enable_lora, max_loras=max_loras,
                               max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                               kv_cache_host_memory_bytes=kv_cache_host_memory_bytes,
                               # absolute: tritonserver runs model.py from another directory
                               kv_offloading_dir=None if kv_offloading_dir is None else
                               str(Path(kv_offloading_dir).resolve()),
                               kv_offloading_disk_size=kv_offloading_disk_size,
                               speculative_config=_speculative_json(speculative_config))
    if not enable_lora and any(v is not None for v in (max_loras, max_lora_rank, max_cpu_loras)):
        raise ValueError("--max-loras, --max-lora-rank and --max-cpu-loras need --enable-lora")
    from kiln.runtime import RuntimeOptions

    # Refused now (a ValueError naming the field), not at Triton's load.
    RuntimeOptions(**params.lora_options(), **params.offloading_options(), **params.speculative_options(),
                   enable_prefix_caching=params.enable_kv_cache_reuse)
    kind = "KIND_GPU" if spec.target.get("device_type") == "cuda" else "KIND_CPU"

    repo = Path(repo).resolve()
    if repo.exists() and not repo.is_dir():
        raise ValueError(f"--output {repo} exists and is not a directory")
    recorded = {"python_path": list(paths), "kiln_version": kiln.__version__,
                "kiln_dir": kiln_package_dir() if record_site else None}
    if layout == "ensemble":
        from kiln.serve.tritonserver.layout_repository import write_layout

        dirs = write_layout(repo, max_batch_size, kind, params.to_strings(), recorded, force)
        return TritonModel(dirs[1], dirs[1] / "config.pbtxt", dirs[1] / "1" / "model.py", max_batch_size, kind,
                           paths, tuple(dirs))
    target = repo / name
    check_target(target, force)

    # Written beside the target and moved into place, so a failure leaves no half-written model behind.
    with staged_directory(target) as staging:
        (staging / "config.pbtxt").write_text(_config_text(name, max_batch_size, kind, params, engine_dir))
        (staging / "1").mkdir()
        shutil.copyfile(MODEL_SOURCE, staging / "1" / "model.py")
        (staging / "1" / ENV_FILE).write_text(json.dumps(recorded, indent=2) + "\n")
    return TritonModel(target, target / "config.pbtxt", target / "1" / "model.py", max_batch_size, kind, paths)


def _speculative_json(config: SpeculativeConfig | dict | None) -> str | None:
    """config.pbtxt's speculative_config: the config's fields that differ from their defaults, as JSON, the model's
    path absolute (tritonserver runs model.py from another directory)."""
    config = speculative_config_of(config)
    if config is None:
        return None
    if config.model is not None:
        config = dataclasses.replace(config, model=str(Path(config.model).resolve()))
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    return json.dumps({k: v for k, v in dataclasses.asdict(config).items()
                       if k in ("method", "num_speculative_tokens") or v != defaults[k]})


def _config_text(name: str, max_batch_size: int, kind: str, params: BackendParameters, engine_dir: Path) -> str:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from kiln.serve.tritonserver.schema import model_config

    config = model_config(name, max_batch_size, backend="python", parameters=params.to_strings())
    config.instance_group.append(mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.Kind.Value(kind), count=1))
    return f"# written by `kiln triton-repo` for the engine {engine_dir}\n" + text_format.MessageToString(config)
