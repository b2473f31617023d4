"""FLUX's parameters and collectives under the rule tables.

- tensor=4: each device holds a quarter of every attention and MLP weight (full-size flux-dev, abstract;
  and the tiny model's real arrays);
- the PipeFusion preset splits the stacked layer axis;
- the compiled step contains exactly the design's collectives, with the bytes the shapes imply;
- preconditions (heads, batch, pipefusion) fail before anything is read or compiled;
- compile work does not grow with depth (blocks are scanned).
"""

import math
import re

import flux_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdit import hlo_stats, load_transformer
from jaxdit.families import load_params
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.models.partitioning import named_shardings, partition_specs
from jaxdit.parallel.layout import SequenceLayout
from sharding_rules import rules_for

FAST = {"xla_backend_optimization_level": 0}

#: Column-parallel (output features over tensor) and row-parallel (input features over tensor) weights.
COLUMN = re.compile(r"(_attn|\.attn)\.[qkv]\.(kernel|bias)$|_mlp\.fc1\.(kernel|bias)$|mlp_in\.(kernel|bias)$")
ROW = re.compile(r"_proj\.kernel$|_mlp\.fc2\.kernel$|out_attn\.kernel$|out_mlp\.kernel$")


def _flat(tree):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(tree)}


def test_tensor4_holds_a_quarter_of_attention_and_mlp_weights():
    mesh = ParallelConfig(tensor=4, ulysses=2).make_mesh()
    state = nnx.state(flux.abstract_model(flux.FluxConfig.preset("flux-dev"), jnp.bfloat16), nnx.Param)
    shapes = {k: v.shape for k, v in _flat(state).items()}
    shardings = _flat(named_shardings(state, rules_for(tensor=4), mesh))
    split = full = local = 0
    for path, shape in shapes.items():
        local_shape = shardings[path].shard_shape(shape)
        if COLUMN.search(path) or ROW.search(path):
            axis = len(shape) - 1 if COLUMN.search(path) else len(shape) - 2
            expected = tuple(d // 4 if i == axis else d for i, d in enumerate(shape))
            assert local_shape == expected, path
            split += math.prod(shape)
            local += math.prod(local_shape)
        else:
            # Embedders, modulation, norms, row-parallel biases, the final layer: replicated.
            assert local_shape == shape, path
            full += math.prod(shape)
    assert local * 4 == split
    # Attention and MLP are 93% of FLUX's 11.9 B parameters; the rest is replicated.
    print(f"flux-dev on tensor=4: {split / 1e9:.2f} B split (a quarter each), {full / 1e9:.2f} B replicated")
    assert split + full == 11_901_408_320


def test_tensor4_real_arrays_quarter_per_device():
    _, model = load_params(flux_tiny.diffusers_folder(True), ParallelConfig(tensor=4, ulysses=2).make_mesh())
    e, f = flux_tiny.HEADS * flux_tiny.HEAD_DIM, 4 * flux_tiny.HEADS * flux_tiny.HEAD_DIM
    expect = {
        "double_blocks.img_attn.q.kernel": (2, e, e // 4),
        "double_blocks.txt_proj.kernel": (2, e // 4, e),
        "double_blocks.img_mlp.fc1.kernel": (2, e, f // 4),
        "double_blocks.img_mlp.fc2.kernel": (2, f // 4, e),
        "single_blocks.mlp_in.bias": (2, f // 4),
        "single_blocks.out_mlp.kernel": (2, f // 4, e),
        "single_blocks.modulation.kernel": (2, e, 3 * e),  # AdaLN: replicated
    }
    params = _flat(nnx.state(model, nnx.Param))
    for path, shape in expect.items():
        shards = params[path].addressable_shards
        assert len(shards) == 8 and all(s.data.shape == shape for s in shards), path


def test_pipefusion_preset_shards_the_layer_axis():
    cfg = flux_tiny.config(True)
    state = nnx.state(flux.abstract_model(cfg), nnx.Param)
    specs = _flat(partition_specs(state, rules_for(tensor=2, pipefusion=2)))
    assert specs["double_blocks.img_attn.q.kernel"] == P("pipefusion", None, "tensor")
    assert specs["single_blocks.out_mlp.kernel"] == P("pipefusion", "tensor", None)
    assert specs["single_blocks.modulation.kernel"] == P("pipefusion", None, None)
    assert specs["img_in.kernel"] == P(None, None)  # not stacked: never on pipefusion
    # Placed on a pipefusion=2 mesh, each device holds one of the two layers of every block stack.
    mesh = ParallelConfig(pipefusion=2, ulysses=4).make_mesh()
    _, model = load_params(flux_tiny.diffusers_folder(True), mesh)
    params = _flat(nnx.state(model, nnx.Param))
    for path, value in params.items():
        stacked = path.startswith(("double_blocks.", "single_blocks."))
        for shard in value.addressable_shards:
            assert shard.data.shape[0] == (1 if stacked else value.shape[0]), path
    # A plain forward refuses it (PipeFusion needs its runner), before reading a weight.
    with pytest.raises(ValueError, match="PipeFusion"):
        load_transformer(flux_tiny.diffusers_folder(True), ParallelConfig(pipefusion=2, ulysses=4))


def test_preconditions_fail_before_loading_or_compiling(monkeypatch):
    folder = flux_tiny.diffusers_folder(True)
    import converters.keymap

    def no_reading(*a, **k):
        raise AssertionError("weights were read before the heads were checked")

    with monkeypatch.context() as m:
        m.setattr(converters.keymap, "place", no_reading)
        with pytest.raises(ValueError, match=r"8 heads cannot be split over ulysses=1 x tensor=3"):
            load_transformer(folder, ParallelConfig(tensor=3))
        with pytest.raises(
            ValueError, match=r"8 heads cannot be split over ulysses=3 x tensor=1.*1, 2, 4, 8"
        ):
            load_transformer(folder, ParallelConfig(ulysses=3))

    fn = load_transformer(folder, ParallelConfig(cfg=2, ulysses=4))
    x = flux_tiny.inputs(True, batch=3)
    with pytest.raises(ValueError, match=r"batch 3 cannot be split over data=1 x cfg=2"):
        fn(**x)
    x = flux_tiny.inputs(True, batch=2)
    with pytest.raises(ValueError, match=r"img_ids has 14 tokens but hidden_states has 15"):
        fn(**{**x, "img_ids": x["img_ids"][:-1]})
    with pytest.raises(ValueError, match=r"embeds the guidance scale"):
        fn(**{**x, "guidance": None})
    with pytest.raises(ValueError, match=r"timestep has shape \(3,\)"):
        fn(**{**x, "timestep": np.zeros(3, np.float32)})
    assert not fn.forward._steps  # nothing was compiled


def test_compiled_step_has_exactly_the_designs_collectives():
    # tensor2 x ring2 x ulysses2, batch 2: per attention layer Ulysses' 4 all-to-alls and Ring's one
    # permute each of K and V; per block one tensor all-reduce after each row-parallel projection
    # (double block: attention out + MLP down for each stream; single block: ONE for linear2's two parts).
    pc = ParallelConfig(tensor=2, ring=2, ulysses=2)
    fn = load_transformer(flux_tiny.diffusers_folder(True), pc, compiler_options=FAST)
    x, _ = flux_tiny.case(True)
    abstract = {k: None if v is None else jax.ShapeDtypeStruct(np.shape(v), v.dtype) for k, v in x.items()}
    compiled = fn.forward.lower(**abstract).compile()
    summary = hlo_stats.summarize(compiled)

    cfg = flux_tiny.config(True)
    depth, single = cfg.depth, cfg.depth_single_blocks
    layers = depth + single
    batch, e, d = 2, cfg.hidden_size, cfg.head_dim
    layout = SequenceLayout((flux_tiny.TEXT_LEN, math.prod(flux_tiny.GRID)), pc.sequence_degree)
    t_local, n_local = layout.local_lengths
    heads_local = cfg.num_heads // pc.tensor
    f32 = 4
    counts = {k: v["count"] for k, v in summary.items() if v["count"] and k != "total"}
    assert set(counts) == {"all-to-all", "collective-permute", "all-reduce"}  # no all-gather, ever
    assert counts["all-to-all"] == 4 * layers
    assert counts["collective-permute"] == 2 * (pc.ring - 1) * layers
    # XLA's all-reduce combiner may fuse the text and image streams' all-reduces of a double block into
    # one (same bytes), so a double block has 2 to 4; a single block exactly one.
    assert 2 * depth + single <= counts["all-reduce"] <= 4 * depth + single
    # Bytes per device (fp32 model): all-reduces of [B, tokens, E] partial sums; all-to-alls of the local
    # [B, T+N, H/tensor, D] q/k/v/output; permutes of the K/V blocks Ulysses gathered.
    assert summary["all-reduce"]["bytes"] == (2 * depth + single) * batch * (t_local + n_local) * e * f32
    assert summary["all-to-all"]["bytes"] == 4 * layers * batch * layout.local_length * heads_local * d * f32
    kv_block = batch * layout.local_length * pc.ulysses * (heads_local // pc.ulysses) * d * f32
    assert summary["collective-permute"]["bytes"] == 2 * (pc.ring - 1) * layers * kv_block


def test_compile_work_does_not_grow_with_depth():
    # The scanned program holds one double and one single block whatever the depth.
    def ops(depth):
        cfg = flux.FluxConfig(
            **{**flux_tiny.config(False).to_json(), "depth": depth, "depth_single_blocks": depth}
        )
        mesh = ParallelConfig().make_mesh(jax.devices()[:1])
        fwd = flux.sharded(flux.abstract_model(cfg), mesh)
        x, _ = flux_tiny.case(False)
        abstract = {
            k: None if v is None else jax.ShapeDtypeStruct(np.shape(v), v.dtype) for k, v in x.items()
        }
        text = fwd.lower(**abstract).as_text()
        return text.count("dot_general"), len(text)

    (dots2, len2), (dots12, len12) = ops(2), ops(12)
    assert dots2 == dots12
    assert abs(len12 - len2) < 0.01 * len2
