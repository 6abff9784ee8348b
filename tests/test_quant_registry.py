"""The quantization scheme registry (kiln/quant/registry.py): one entry per scheme, registered by the
scheme's own module; formats.py's old tuples are its views; device support reads its minimum GPU."""

from __future__ import annotations

import pytest
import torch

from kiln.engine_format import EngineBuildConfig, EngineError
from kiln.quant import formats, registry
from kiln.quant.base import QuantError
from kiln.quant.registry import QuantScheme, SchemeParams, scheme, schemes
from kiln.quant.selection import LayerSelection
from kiln.runtime.worker import device_support
from kiln.runtime.worker.device_support import check_device_supports

# Each scheme and the module that owns (and registers) it.
OWNERS = {
    "full_prec": "kiln.quant.full_prec",
    "fp8": "kiln.quant.fp8",
    "fp8_dynamic": "kiln.quant.fp8",
    "fp8_block": "kiln.quant.fp8_block",
    "mxfp4": "kiln.quant.mxfp4",
    "int8_sq": "kiln.quant.int8_sq",
    "int8_dynamic": "kiln.quant.int8_sq",
    "int4_awq": "kiln.quant.int4_awq",
    "int8_wo": "kiln.quant.weight_only_formats",
    "int4_wo": "kiln.quant.weight_only_formats",
    "weight_only": "kiln.quant.weight_only_formats",
}


def test_every_scheme_is_registered_once_by_its_own_module():
    names = [s.name for s in schemes()]
    assert sorted(names) == sorted(OWNERS) and len(set(names)) == len(names)
    for entry in schemes():
        assert entry.config.__module__ == OWNERS[entry.name], entry.name
    assert len({s.order for s in schemes()}) == len(names)  # a total listing order


def test_a_second_entry_under_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'fp8' is registered twice"):
        registry.register(QuantScheme("fp8", lambda p: None, order=99))
    assert scheme("fp8").order == 1  # the original entry stays


def test_the_old_tuples_are_the_registry_views():
    every = schemes()
    assert formats.QFORMATS == tuple(s.name for s in every if s.buildable)
    assert formats.QFORMATS == ("full_prec", "fp8", "int8_sq", "int4_awq", "int8_wo", "int4_wo")
    assert formats.CHECKPOINT_SCHEMES == tuple(s.name for s in every if not s.buildable)
    assert formats.CHECKPOINT_SCHEMES == ("fp8_dynamic", "fp8_block", "int8_dynamic", "weight_only", "mxfp4")
    assert formats.ENGINE_SCHEMES == formats.QFORMATS + formats.CHECKPOINT_SCHEMES
    assert formats.GROUPED == tuple(s.name for s in every if s.grouped) == ("int4_awq", "int4_wo")
    assert formats.CALIBRATED == tuple(s.name for s in every if s.calibrated) == ("fp8", "int8_sq", "int4_awq")
    assert formats.DEFAULT_GROUP_SIZE == registry.DEFAULT_GROUP_SIZE == 128


def test_the_config_factory_is_formats_quant_config():
    selection = LayerSelection()
    assert scheme("full_prec").config(SchemeParams(selection)) is None
    made = scheme("int4_awq").config(SchemeParams(selection))
    assert made == formats.quant_config("int4_awq") and made.group_size == registry.DEFAULT_GROUP_SIZE
    assert scheme("weight_only").config(SchemeParams(selection, 32, bits=4, zero_point=True)) == \
        formats.quant_config("weight_only", 32, bits=4, zero_point=True)


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(registry.UnknownSchemeError) as info:
        scheme("int3")
    assert "'int3'" in str(info.value) and all(s.name in str(info.value) for s in schemes())
    with pytest.raises(QuantError, match="valid: full_prec, fp8, int8_sq, int4_awq, int8_wo, int4_wo, fp8_dynamic"):
        formats.quant_config("int3")


def _build(qformat: str) -> EngineBuildConfig:
    return EngineBuildConfig(dtype="bfloat16", max_batch_size=8, max_num_tokens=256, max_seq_len=1024,
                             kv_block_size=16, kv_cache_dtype="bfloat16", quantization={"qformat": qformat})


def test_device_support_reads_min_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    needing = [s.name for s in schemes() if s.min_compute_capability]
    assert needing == ["fp8", "fp8_dynamic", "fp8_block"]
    for name in needing:
        with pytest.raises(EngineError, match="compute capability 8.9 or newer"):
            check_device_supports(_build(name), torch.device("cuda"))
    check_device_supports(_build("int8_sq"), torch.device("cuda"))
    # A scheme registered with a newer minimum is refused on a GPU that runs FP8: the entry decides.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_device_supports(_build("fp8"), torch.device("cuda"))
    newer = QuantScheme("fp8", scheme("fp8").config, order=1, min_compute_capability=(10, 0))
    monkeypatch.setattr(device_support, "schemes", lambda: (newer,))
    with pytest.raises(EngineError, match="compute capability 10.0 or newer"):
        check_device_supports(_build("fp8"), torch.device("cuda"))
