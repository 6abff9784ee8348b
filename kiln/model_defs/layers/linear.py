"""Linear layers that hold a *linear method*: which tensors the layer stores, and how it computes x @ W^T.

The idea is vLLM's "quant method". A model file asks a `LinearFactory` for each linear by what tensor
parallelism would do with it (`column`, `row`, `replicated`, `lm_head`) and never sees the method, so
quantized methods (from `kiln.quant`) and column/row-parallel layers plug in here without touching a
model file. Unless a QuantConfig says otherwise a layer is unquantized; with a mapping of tp_size > 1,
`column` and `row` layers hold this rank's share (`parallel.FeatureShard`) and combine the shares with the
factory's `TPComm`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_input import Fp8Input
from .parallel import FeatureShard, TPComm, even_shard, gather_vocab, head_shard, require_comm, vocab_shard

if TYPE_CHECKING:
    from kiln.engine_format.mapping import Mapping

Parallelism = Literal["column", "row", "replicated", "vocab"]


@dataclass(frozen=True)
class TensorDecl:
    """One tensor a linear method stores on its layer; it becomes an engine tensor `<prefix>.<name>`."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class LinearMethod(ABC):
    """How one linear layer stores its weights and computes its product.

    A method is a small immutable object; the layer holds it and the tensors it declared.
    """

    # Whether `apply_fp8` takes the input already quantized by its producer (fp8_input.py).
    accepts_fp8_input: bool = False

    @abstractmethod
    def tensors(self, in_features: int, out_features: int, bias: bool) -> dict[str, TensorDecl]:
        """The tensors the layer needs, by attribute name, in the order they are stored."""

    def layer_tensors(self, layer: nn.Module, in_features: int, out_features: int,
                      bias: bool) -> dict[str, TensorDecl]:
        """The tensors of this particular layer: `tensors`, unless the method keeps something per part of a
        fused layer (it reads `layer.output_sizes`)."""
        return self.tensors(in_features, out_features, bias)

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features], in x's dtype."""

    def apply_fp8(self, layer: nn.Module, x: Fp8Input) -> torch.Tensor:
        """`apply` on an input its producer quantized: x.x_q [T, in_features] float8_e4m3fn -> [T, out_features]
        in the network's dtype. Only methods with accepts_fp8_input implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not take FP8 input")

    def create(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        """Registers the declared tensors on `layer` as parameters, uninitialized, on the current default
        device (meta when the builder only wants names, shapes and dtypes)."""
        for name, decl in self.layer_tensors(layer, in_features, out_features, bias).items():
            tensor = torch.empty(decl.shape, dtype=decl.dtype)
            # Integer and FP8 tensors (quantized weights) cannot require grad.
            trainable = decl.dtype in (torch.float32, torch.float16, torch.bfloat16)
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=trainable))


@dataclass(frozen=True)
class UnquantizedLinear(LinearMethod):
    """weight: [out, in] and optional bias: [out], both in `dtype`; the product is F.linear."""

    dtype: torch.dtype = torch.float32

    def tensors(self, in_features: int, out_features: int, bias: bool) -> dict[str, TensorDecl]:
        decls = {"weight": TensorDecl((out_features, in_features), self.dtype)}
        if bias:
            decls["bias"] = TensorDecl((out_features,), self.dtype)
        return decls

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]; a layer without a bias has no `bias` attribute.
        return F.linear(x, layer.weight, getattr(layer, "bias", None))


class Linear(nn.Module):
    """A linear layer whose tensors and product are its method's.

    `output_sizes` are the row counts of the parts a fused layer is made of ([q; k; v], [gate; up]), which
    a per-part scale needs; `parallel` is how tensor parallelism splits it. On a tensor-parallel rank the
    features are this rank's (`shard` says which of the whole layer's they are) and `collective` combines
    the ranks' outputs (a row layer's all-reduce, the lm_head's gather).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod, *,
                 prefix: str = "", output_sizes: tuple[int, ...] | None = None,
                 parallel: Parallelism = "replicated", shard: FeatureShard | None = None,
                 collective: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.collective = collective
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = output_sizes or (out_features,)
        if sum(self.output_sizes) != out_features:
            raise ValueError(f"{prefix}: output_sizes {self.output_sizes} do not add up to {out_features}")
        self.prefix = prefix
        self.parallel = parallel
        self.method = method
        method.create(self, in_features, out_features, bias)
        # hook(x, y) adding to this rank's output in place before the collective (the runtime's LoRA slots,
        # runtime/worker/lora_slots.py); None: nothing is added.
        self.lora_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        # x: [T, in] -> [T, out]; an Fp8Input only reaches a layer whose method accepts it (fp8_consumer).
        y = self.method.apply_fp8(self, x) if isinstance(x, Fp8Input) else self.method.apply(self, x)
        if self.lora_hook is not None:
            if isinstance(x, Fp8Input):
                raise NotImplementedError(f"{self.prefix}: LoRA adapters on FP8-input layers are not supported")
            self.lora_hook(x, y)
        return y if self.collective is None else self.collective(y)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, {self.parallel}, method={self.method}"


class TiedLinear(nn.Module):
    """A linear layer that computes with another module's `weight` (a tied lm_head reads the embedding).

    It registers no parameters, so the engine stores the matrix once, under the owner's name.
    """

    def __init__(self, owner: nn.Module, method: LinearMethod,
                 collective: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        # In a tuple so that nn.Module does not register the owner a second time (state_dict would list
        # its weight again); the weight is read through it at call time, so loading with assign=True works.
        self._owner = (owner,)
        self.method = method
        self.collective = collective  # a vocab-parallel embedding's heads gather the ranks' logits

    @property
    def weight(self) -> torch.Tensor:
        return self._owner[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)  # x: [T, in] -> [T, out]
        return y if self.collective is None else self.collective(y)


# Defined here, where it is used, rather than in kiln.quant (which builds on LinearMethod): the formats
# implement it, and `kiln.quant.base` re-exports it as their home name.
@runtime_checkable
class QuantConfig(Protocol):
    """Chooses how each linear layer of a network stores and multiplies its weights."""

    def linear_method(self, prefix: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> LinearMethod | None:
        """The method for the layer at module path `prefix` (e.g. "model.layers.0.mlp.down_proj", or
        "lm_head"), whose activations are `dtype`; None leaves that layer unquantized. Raises QuantError
        naming the layer and its sizes when the format cannot take them."""
        ...


@dataclass(frozen=True)
class LinearFactory:
    """Makes every linear layer of one network, for one precision, quantization and rank.

    `dtype` is the dtype of every unquantized floating tensor (the network's norms and embeddings too).
    Layers are named by their module path (`prefix`, e.g. "model.layers.0.self_attn.qkv_proj"), which is
    how a QuantConfig picks a method per layer. With `mapping.tp_size` > 1, `column` and `row` layers hold
    this rank's share and `comm` combines them (None on the builder's meta networks, which never run).
    """

    quant: QuantConfig | None = None
    mapping: Mapping | None = None
    dtype: torch.dtype = torch.float32
    comm: TPComm | None = None

    @property
    def tp_size(self) -> int:
        return 1 if self.mapping is None else self.mapping.tp_size

    def method(self, prefix: str, in_features: int, out_features: int) -> LinearMethod:
        """The quantization config's method for this layer, or unquantized when there is none. It is chosen
        by the whole layer's shape, so every rank of a tensor-parallel engine picks the same one."""
        chosen = None if self.quant is None else self.quant.linear_method(prefix, in_features, out_features,
                                                                          self.dtype)
        return chosen if chosen is not None else UnquantizedLinear(self.dtype)

    def column(self, prefix: str, in_features: int, output_sizes: int | Sequence[int],
               bias: bool = False, shard: FeatureShard | None = None) -> Linear:
        """Output features split over ranks (qkv_proj, gate_up_proj). A fused layer gives its parts' sizes,
        e.g. (q_size, kv_size, kv_size): each rank holds its share of every part (`shard`, default an even
        split of each part)."""
        sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        method = self.method(prefix, in_features, sum(sizes))
        if self.tp_size > 1:
            shard = shard or even_shard("output", sizes, self.mapping, prefix)
            sizes = shard.local_sizes
        return Linear(in_features, sum(sizes), bias, method, prefix=prefix, output_sizes=sizes, parallel="column",
                      shard=shard if self.tp_size > 1 else None)

    def attention_qkv(self, prefix: str, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      bias: bool = False) -> Linear:
        """The fused [q; k; v] projection, column-parallel by whole heads (KV heads replicated when there are
        fewer than ranks)."""
        sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        shard = head_shard(num_heads, num_kv_heads, head_dim, self.mapping) if self.tp_size > 1 else None
        return self.column(prefix, hidden_size, sizes, bias, shard)

    def row(self, prefix: str, in_features: int, out_features: int, bias: bool = False) -> Linear:
        """Input features split over ranks (o_proj, down_proj); the partial outputs are summed (all-reduce).
        Only rank 0's share of the bias is non-zero, so the sum adds it once."""
        method = self.method(prefix, in_features, out_features)
        if self.tp_size == 1:
            return Linear(in_features, out_features, bias, method, prefix=prefix, parallel="row")
        shard = even_shard("input", (in_features,), self.mapping, prefix)
        return Linear(shard.local_sizes[0], out_features, bias, method, prefix=prefix, parallel="row",
                      shard=shard, collective=self._reduce(prefix))

    def replicated(self, prefix: str, in_features: int, out_features: int, bias: bool = False) -> Linear:
        """The whole layer on every rank (small layers, e.g. an MoE router)."""
        return Linear(in_features, out_features, bias, self.method(prefix, in_features, out_features),
                      prefix=prefix, parallel="replicated")

    def lm_head(self, prefix: str, hidden_size: int, vocab_size: int,
                tied_to: nn.Module | None = None) -> nn.Module:
        """hidden [N, H] -> logits [N, V]. Tied to an embedding it reuses that module's weight [V, H],
        stored once and unquantized, like the embedding itself. With tp_size > 1 each rank computes its
        rows of the (padded) vocabulary and the ranks' logits are gathered."""
        gather = None
        if self.tp_size > 1:
            comm = self.comm
            gather = lambda logits: gather_vocab(comm, logits, vocab_size)  # noqa: E731
        if tied_to is not None:
            return TiedLinear(tied_to, UnquantizedLinear(self.dtype), gather)
        method = self.method(prefix, hidden_size, vocab_size)
        if self.tp_size == 1:
            return Linear(hidden_size, vocab_size, False, method, prefix=prefix, parallel="column")
        shard = vocab_shard(vocab_size, self.mapping)
        return Linear(hidden_size, shard.local_sizes[0], False, method, prefix=prefix, parallel="vocab",
                      shard=shard, collective=gather)

    def _reduce(self, prefix: str) -> Callable[[torch.Tensor], torch.Tensor]:
        comm = self.comm
        return lambda y: require_comm(comm, prefix).all_reduce(y)
