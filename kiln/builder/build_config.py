"""The settings of one `kiln build`, typed and checked (what it writes into engine.json is
`kiln.engine_format.EngineBuildConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kiln.engine_format import ENGINE_DTYPES
from kiln.engine_format.limits import check_build_limits, check_max_beam_width
from kiln.quant.base import QuantError
from kiln.quant.formats import DEFAULT_GROUP_SIZE, KV_CACHE_QUANT_DTYPES, QFORMATS, parse_qformat
from kiln.quant.registry import QuantScheme

DTYPE_CHOICES = ("auto", *ENGINE_DTYPES)
DEVICE_CHOICES = ("cpu", "cuda")
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_QUANT_DTYPES)


@dataclass(frozen=True)
class BuildConfig:
    """Upper bounds the runtime may lower but never raise, plus how the weights are stored."""

    dtype: str = "auto"  # auto = the checkpoint's torch_dtype (float32 when it names none)
    device: str = "cpu"  # the device type the engine targets
    max_batch_size: int = 64  # requests per step
    max_num_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_seq_len: int | None = None  # prompt + output; None = the model's max_position_embeddings
    kv_block_size: int = 16  # tokens per KV-cache block
    dummy_weights: bool = False  # random weights from config.json alone (benchmarks)
    seed: int = 0  # for dummy weights
    # With dummy weights: write no weight files, the runtime draws them on the device at load (models whose
    # weights do not fit the disk)
    weights_at_load: bool = False
    tp_size: int = 1  # tensor-parallel ranks the engine is split over (rank<N>.safetensors each)
    # device cuda: time the tunable kernels' launch settings at the engine's shapes on this GPU and record the
    # winners in target.kernel_settings (builder/tune.py); False leaves the runtime its shape heuristics
    tune: bool = True
    # device cuda: compile every kernel serving this engine launches (a child process starts it and runs a short
    # workload with an empty Triton cache) and store the binaries in the engine (kernels/triton/, see
    # builder/kernel_store.py), so that a fresh machine compiles nothing. `kiln build --device cuda` sets it unless
    # --no-kernels; off by default here, since it starts the engine once more (tests build many engines)
    kernels: bool = False
    # Quantization (TensorRT-LLM's names): the weights' format and the KV cache's dtype. `qformat` is the
    # scheme's registry entry (the CLI passes the one its --qformat parsed); a name given here is parsed once,
    # in __post_init__, so the builder reads the entry (.name, .grouped, .config) and never the name again.
    qformat: QuantScheme | str = "full_prec"
    kv_cache_dtype: str = "auto"  # auto = the engine dtype
    awq_block_size: int = DEFAULT_GROUP_SIZE  # group size of the INT4 formats
    calib_dataset: str | None = None  # plain text or JSON lines with "text"; None = kiln's default sample
    # calibration samples; None (--calib-size not given): up to 512 (quant.calib_data.DEFAULT_CALIB_SIZE), as many
    # as the data gives when fewer, with no warning (a size asked for and not filled is warned about)
    calib_size: int | None = None
    calib_max_seq_len: int = 512  # tokens per calibration sample
    # A checkpoint tensor holding NaN or Inf is refused (the engine would sample from NaN logits); True builds
    # it anyway with a warning naming the tensor (--allow-non-finite)
    allow_non_finite: bool = False
    max_beam_width: int = 1  # beams a beam-search request may have (TensorRT-LLM's --max_beam_width)
    # A pre-quantized checkpoint whose format allows it (MXFP4: GPT-OSS's experts) is dequantized to the engine
    # dtype at build instead of kept in its format (--dequantize)
    dequantize: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPE_CHOICES)}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device={self.device!r} must be one of {', '.join(DEVICE_CHOICES)}")
        # The engine's limits, bounded as engine.json's are (engine_format/limits.py); max_seq_len again once the
        # model's default is known.
        check_build_limits(max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                           max_seq_len=self.max_seq_len, kv_block_size=self.kv_block_size)
        check_max_beam_width(self.max_beam_width)
        if self.max_beam_width > min(self.max_batch_size, self.max_num_tokens):
            raise ValueError(f"max_beam_width={self.max_beam_width} exceeds max_batch_size={self.max_batch_size} or "
                             f"max_num_tokens={self.max_num_tokens}: every beam is a row of each step")
        for name in ("awq_block_size", "calib_size", "calib_max_seq_len", "tp_size"):
            value = getattr(self, name)
            if name == "calib_size" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.weights_at_load and not self.dummy_weights:
            raise ValueError("weights_at_load (--no-weight-files) needs dummy_weights (--dummy-weights): a "
                             "checkpoint's weights must be written into the engine")
        if self.kernels and self.device != "cuda":
            raise ValueError(f"kernels=True stores compiled GPU kernels: it needs device='cuda', not {self.device!r}")
        self._parse_qformat()
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
        if self.awq_block_size % 2 or self.awq_block_size < 2:
            raise ValueError(f"awq_block_size={self.awq_block_size} must be an even number >= 2 (INT4 values "
                             f"are packed two to a byte)")

    def _parse_qformat(self) -> None:
        if isinstance(self.qformat, QuantScheme) and self.qformat.buildable:
            return
        name = self.qformat.name if isinstance(self.qformat, QuantScheme) else self.qformat
        try:
            object.__setattr__(self, "qformat", parse_qformat(name))
        except QuantError:
            raise ValueError(f"qformat={name!r} is not a quantization format; valid: "
                             f"{', '.join(QFORMATS)}") from None

    @property
    def quantizes(self) -> bool:
        return self.qformat.name != "full_prec" or self.kv_cache_dtype != "auto"

    def to_dict(self) -> dict:
        """The settings as JSON values (`qformat` by its name)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "qformat": self.qformat.name}
