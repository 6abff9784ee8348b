"""From float weights (and calibration statistics) to a quantized network's engine tensors.

The quantized network, built on the meta device, says which layers are quantized and with which method;
the float network's recipes say which checkpoint tensors each layer's weight is made of ([q; k; v]). A
quantized layer's tensors are made together by its method's `quantize` from those parts, once per layer
(the writer asks for them one after another, so one layer's worth is held at a time); every other tensor
is its float recipe's, cast to the engine dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.model_defs import ModelConfig, ModelDef, build_network
from kiln.model_defs.layers.linear import Linear
from kiln.model_defs.recipes import Concat, Single

from .base import LinearPart, QuantConfig, QuantError, QuantizedLinearMethod

# (engine tensor name) -> that tensor of the float network, in the engine dtype
FloatProducer = Callable[[str], torch.Tensor]


def quantized_layers(model_def: ModelDef, config: ModelConfig, quant: QuantConfig,
                     dtype: torch.dtype) -> dict[str, Linear]:
    """The network's quantized linear layers by module path (on the meta device)."""
    with torch.device("meta"):
        model = build_network(model_def, config, quant, dtype=dtype)
    return {name: m for name, m in model.named_modules()
            if isinstance(m, Linear) and isinstance(m.method, QuantizedLinearMethod)}


def needs_calibration(layers: dict[str, Linear]) -> bool:
    return any(layer.method.needs_calibration for layer in layers.values())


# (layer prefix, layer) -> the layer's float parts, in row order, with their calibration statistics
PartsReader = Callable[[str, Linear], list[LinearPart]]
# (layer prefix, layer) -> the layer's engine tensors (all but its bias)
LayerMaker = Callable[[str, Linear], dict[str, torch.Tensor]]


def quantize_parts(parts: PartsReader) -> LayerMaker:
    """Layers made by their method's `quantize` from float parts (kiln build --qformat)."""
    return lambda prefix, layer: layer.method.quantize(parts(prefix, layer))


class QuantizedProducer:
    """`producer(name, dtype, shape)` for every tensor of the quantized network: a quantized layer's
    tensors from `make_layer`, any other tensor (and every bias) from `float_tensor(name)`."""

    def __init__(self, layers: dict[str, Linear], make_layer: LayerMaker, float_tensor: FloatProducer) -> None:
        self.layers = layers
        self.make_layer = make_layer
        self.float_tensor = float_tensor
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def __call__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        prefix, _, attr = name.rpartition(".")
        if prefix not in self.layers or attr == "bias":
            return self.float_tensor(name)
        if self._cached is None or self._cached[0] != prefix:
            self._cached = (prefix, self.make_layer(prefix, self.layers[prefix]))
        tensor = self._cached[1][attr]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise QuantError(f"{name}: the format made {tensor.dtype} {list(tensor.shape)}, the network declares "
                             f"{dtype} {list(shape)}")
        return tensor


def layer_modules(model_def: ModelDef, config: ModelConfig, layers: dict[str, Linear]) -> dict[str, list[str]]:
    """Each quantized layer's checkpoint modules in row order, from the float network's recipe of its
    weight ("…qkv_proj" -> […q_proj, …k_proj, …v_proj])."""
    recipes = model_def.recipes(config, [f"{prefix}.weight" for prefix in layers])
    modules = {}
    for prefix in layers:
        recipe = recipes[f"{prefix}.weight"]
        if not isinstance(recipe.combine, Single | Concat) or (isinstance(recipe.combine, Concat)
                                                               and recipe.combine.dim != 0):
            raise QuantError(f"{prefix}.weight: a weight made by {recipe.combine} cannot be quantized yet")
        modules[prefix] = [part.removesuffix(".weight") for part in recipe.parts]
    return modules


class CheckpointParts:
    """A layer's parts read through the float network's recipes: `read(part)` gives a checkpoint tensor (as
    calibration left it, when it ran) and `linears` are the calibration's statistics by module path (None
    without calibration)."""

    def __init__(self, model_def: ModelDef, config: ModelConfig, layers: dict[str, Linear],
                 read: Callable[[str], torch.Tensor], linears: dict[str, LinearPart] | None = None) -> None:
        self.read = read
        self.linears = linears
        self.recipes = model_def.recipes(config, [f"{prefix}.weight" for prefix in layers])

    def __call__(self, prefix: str, layer: Linear) -> list[LinearPart]:
        engine_name = f"{prefix}.weight"
        recipe = self.recipes[engine_name]
        if not isinstance(recipe.combine, Single | Concat) or (isinstance(recipe.combine, Concat)
                                                               and recipe.combine.dim != 0):
            raise QuantError(f"{engine_name}: a weight made by {recipe.combine} cannot be quantized yet")
        parts = []
        for part_name in recipe.parts:
            weight = self.read(part_name)
            if recipe.transform is not None:
                weight = recipe.transform(engine_name, part_name, weight)
            module = part_name.removesuffix(".weight")
            stats = None if self.linears is None else self.linears.get(module)
            if self.linears is not None and stats is None:
                raise QuantError(f"{engine_name}: calibration measured no {module}")
            if stats is None:
                parts.append(LinearPart(module, weight.float()))
            else:
                parts.append(LinearPart(module, weight.float(), stats.weight_amax, stats.input_amax,
                                        stats.pre_quant_scale))
        return parts


def dummy_parts(float_tensor: FloatProducer) -> PartsReader:
    """For --dummy-weights: a quantized layer's parts are its random float weight cut into the parts it fuses
    ([q; k; v], [gate; up]: formats that keep something per part, such as AWQ's per-part pre_quant_scale,
    declare that many), with a made-up input range (speed benchmarks need the shapes and dtypes, not the
    accuracy)."""

    def parts(prefix: str, layer: Linear) -> list[LinearPart]:
        weight = float_tensor(f"{prefix}.weight").float()  # [out, in]
        pieces = weight.split(list(getattr(layer, "output_sizes", (weight.shape[0],))))
        return [LinearPart(prefix if len(pieces) == 1 else f"{prefix}.part{i}", piece, input_amax=torch.tensor(4.0))
                for i, piece in enumerate(pieces)]

    return parts
