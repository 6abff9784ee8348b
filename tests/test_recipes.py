"""Weight recipes: the default fusion rules, every combine, the per-part transform, the shape check, and
how the builder's checkpoint producer uses them (missing parts, shapes, unused tensors, casting)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from model_factory import make_checkpoint
from safetensors.torch import load_file, save_file

from kiln.builder.build import BuildError, checkpoint_producer, load_model_config, param_specs
from kiln.checkpoints.reader import CheckpointReader
from kiln.model_defs.recipes import Concat, Recipe, Single, Stack, consumed_parts, fused_recipe, fused_recipes

ATTN = "model.layers.3.self_attn"


def numbered(*shape, start=0):
    return torch.arange(start, start + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_default_recipes_fuse_qkv_and_gate_up_by_rows(kind):
    assert fused_recipe(f"{ATTN}.qkv_proj.{kind}") == Recipe(
        tuple(f"{ATTN}.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")), Concat(0))
    assert fused_recipe(f"model.layers.0.mlp.gate_up_proj.{kind}") == Recipe(
        (f"model.layers.0.mlp.gate_proj.{kind}", f"model.layers.0.mlp.up_proj.{kind}"), Concat(0))


def test_other_tensors_are_copied_by_name():
    names = ["model.embed_tokens.weight", f"{ATTN}.o_proj.weight", "model.norm.weight", "lm_head.weight"]
    recipes = fused_recipes(None, names)
    assert recipes == {n: Recipe((n,)) for n in names}
    assert all(isinstance(r.combine, Single) for r in recipes.values())


@pytest.mark.parametrize(("combine", "shapes", "expected"), [
    (Concat(0), [(4, 3), (2, 3), (2, 3)], (8, 3)),   # fused rows (qkv)
    (Concat(1), [(4, 3), (4, 5)], (4, 8)),           # packed columns (AWQ/GPTQ)
    (Concat(-1), [(2, 1), (2, 2)], (2, 3)),
    (Stack(0), [(4, 3), (4, 3), (4, 3)], (3, 4, 3)),  # MoE experts
    (Stack(1), [(4, 3), (4, 3)], (4, 2, 3)),
])
def test_each_combine_makes_the_shape_expected_shape_predicts(combine, shapes, expected):
    parts = {f"p{i}": numbered(*s, start=100 * i) for i, s in enumerate(shapes)}
    recipe = Recipe(tuple(parts), combine)
    made = recipe.make("engine.t", parts.__getitem__)
    assert tuple(made.shape) == expected == recipe.expected_shape("engine.t", shapes)
    reference = (torch.cat if isinstance(combine, Concat) else torch.stack)(list(parts.values()), combine.dim)
    assert torch.equal(made, reference)


@pytest.mark.parametrize(("combine", "shapes"), [
    (Concat(0), [(4, 3), (2, 4)]),
    (Concat(1), [(4, 3), (5, 3)]),
    (Stack(0), [(4, 3), (4, 2)]),
])
def test_parts_that_do_not_combine_have_no_expected_shape(combine, shapes):
    assert Recipe(("a", "b"), combine).expected_shape("t", shapes) is None


def test_a_single_recipe_has_one_part():
    with pytest.raises(ValueError, match="single-part recipe got 2 parts"):
        Recipe(("a", "b"))
    with pytest.raises(ValueError, match="at least one part"):
        Recipe((), Concat(0))
    assert Recipe(("a",)).expected_shape("t", [(2, 3), (2, 3)]) is None  # wrong number of shapes


def test_transform_runs_on_each_part_before_combining():
    """A tensor-parallel sharder: rank 1 of 2 takes its half of q, k and v, so qkv is [q_1; k_1; v_1]."""
    calls = []

    def shard(engine_name, part_name, t):
        calls.append((engine_name, part_name))
        return t.chunk(2, dim=0)[1]

    q, k, v = numbered(4, 3), numbered(2, 3, start=100), numbered(2, 3, start=200)
    parts = {"q": q, "k": k, "v": v}
    recipe = Recipe(("q", "k", "v"), Concat(0), transform=shard)
    made = recipe.make("qkv.weight", parts.__getitem__)
    assert torch.equal(made, torch.cat([q[2:], k[1:], v[1:]]))
    assert calls == [("qkv.weight", "q"), ("qkv.weight", "k"), ("qkv.weight", "v")]
    assert recipe.expected_shape("qkv.weight", [(4, 3), (2, 3), (2, 3)]) == (4, 3)


def test_expected_shape_sees_the_parts_dtypes():
    """A dequantizer unpacks int32 words into 8 int4 columns each; the shape check runs it on meta."""

    def unpack(engine_name, part_name, t):
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=t.device)
        return ((t[:, :, None] >> shifts) & 0xF).reshape(t.shape[0], -1).float()

    recipe = Recipe(("packed",), transform=unpack)
    assert recipe.expected_shape("w", [(4, 2)], [torch.int32]) == (4, 16)
    assert recipe.make("w", {"packed": torch.full((4, 2), 0x76543210, dtype=torch.int32)}.__getitem__)[0].tolist() \
        == [0, 1, 2, 3, 4, 5, 6, 7] * 2


def test_consumed_parts_is_every_part_of_every_recipe():
    recipes = fused_recipes(None, [f"{ATTN}.qkv_proj.weight", "model.norm.weight"])
    assert consumed_parts(recipes.values()) == {f"{ATTN}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")} | {
        "model.norm.weight"}


# -- the builder's checkpoint producer ------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("recipes") / "ckpt", tokenizer=False)
    return path


def producer_for(checkpoint, dtype=torch.float32, recipes=None):
    model_def, config = load_model_config(checkpoint)
    if recipes is not None:
        model_def = dataclasses.replace(model_def, recipes=recipes)
    specs = param_specs(model_def, config, dtype)
    reader = CheckpointReader(checkpoint)
    return specs, reader, checkpoint_producer(reader, model_def, config, specs)


def test_producer_applies_the_recipe_then_casts_to_the_engine_dtype(checkpoint):
    specs, reader, produce = producer_for(checkpoint, torch.bfloat16)
    spec = next(s for s in specs if s.name == "model.layers.1.mlp.gate_up_proj.weight")
    fused = torch.cat([reader.get("model.layers.1.mlp.gate_proj.weight"), reader.get("model.layers.1.mlp.up_proj.weight")])
    made = produce(spec)
    assert made.dtype == torch.bfloat16 and torch.equal(made, fused.to(torch.bfloat16))


def test_producer_uses_the_model_defs_recipes_and_their_transforms(checkpoint):
    def doubled_norms(config, names):
        recipes = fused_recipes(config, names)
        return {n: dataclasses.replace(r, transform=lambda e, p, t: 2 * t) if n.endswith("norm.weight") else r
                for n, r in recipes.items()}

    specs, reader, produce = producer_for(checkpoint, recipes=doubled_norms)
    spec = next(s for s in specs if s.name == "model.norm.weight")
    assert torch.equal(produce(spec), 2 * reader.get("model.norm.weight"))


def test_producer_checks_shapes_through_the_recipe(checkpoint):
    def halved_embedding(config, names):
        recipes = fused_recipes(config, names)
        recipes["model.embed_tokens.weight"] = Recipe(("model.embed_tokens.weight",),
                                                      transform=lambda e, p, t: t.chunk(2)[0])
        return recipes

    with pytest.raises(BuildError, match=r"implies model\.embed_tokens\.weight of shape .*does config\.json belong"):
        producer_for(checkpoint, recipes=halved_embedding)


def test_producer_names_missing_parts(checkpoint):
    def with_a_missing_part(config, names):
        recipes = fused_recipes(config, names)
        recipes["model.norm.weight"] = Recipe(("model.norm.weight", "model.final_norm.weight"), Stack(0))
        return recipes

    with pytest.raises(BuildError, match=r"lacks tensors the model needs: model\.final_norm\.weight"):
        producer_for(checkpoint, recipes=with_a_missing_part)


def test_tensors_no_recipe_consumes_are_reported_once(checkpoint, tmp_path, caplog):
    extra = tmp_path / "ckpt"
    extra.mkdir()
    (extra / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old checkpoints; never reported
    weights["model.extra_head.weight"] = torch.ones(2, 2)
    save_file(weights, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="kiln.builder"):
        producer_for(extra)
    [record] = caplog.records
    assert "has 1 tensors the model does not use" in record.getMessage()
    assert "model.extra_head.weight" in record.getMessage()
