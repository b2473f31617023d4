"""The BFL (FLUX) and original (Wan 2.1) layouts, checked against diffusers' own converters.

jaxdit reads and writes these layouts through one key table per layout, used both ways; a mistake shared
by the two directions (say, BFL's q and k swapped in the table) would survive jaxdit's own round trips.
Here the other side is independent: diffusers' single-file converters
(``diffusers/loaders/single_file_utils.py``: ``convert_flux_transformer_checkpoint_to_diffusers``,
``convert_wan_transformer_to_diffusers``).

- Reader: a random state dict in the original layout, its keys and shapes written out here from the
  original model code (BFL ``src/flux/model.py`` and ``modules/layers.py``; Wan ``wan/modules/model.py``),
  is loaded by jaxdit directly, and also converted by diffusers, loaded into diffusers' model (strictly),
  saved and loaded by jaxdit as a diffusers folder: both give bit-identical parameters.
- Writer: jaxdit writes the tiny diffusers models in the original layout (``write_bfl``,
  ``write_original``); diffusers' converter reads the files back into exactly the original state dict.

diffusers' FLUX converter hard-codes FLUX.1's widths for one split: a single block's ``linear1`` rows
are cut at [3072, 3072, 3072, 12288] (q, k, v, MLP). For the tiny model each segment (of E, E, E and 4E
rows) is placed at the start of its full-width slot before the conversion and cut back after it; this
moves rows by segment size only, so the segments' meaning still comes from diffusers.
"""

from __future__ import annotations

import json

import flux_tiny
import numpy as np
import pytest
import torch
import wan_tiny
from diffusers import FluxTransformer2DModel, WanTransformer3DModel
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_wan_transformer_to_diffusers,
)
from flax import nnx
from safetensors.numpy import load_file

from converters.flux import write_bfl
from converters.safetensors_io import write_safetensors
from converters.wan import write_original
from jaxdit.families import load_params
from jaxdit.mesh import single_device_mesh

#: diffusers' FLUX converter: the rows of linear1 per segment (FLUX.1's inner_dim 3072, mlp_ratio 4).
FULL_WIDTH_SEGMENTS = (3072, 3072, 3072, 12288)


def _params(path, config=None) -> dict[str, np.ndarray]:
    _, model = load_params(path, single_device_mesh(), config=config)
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _converted(convert, state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """diffusers' converter on a copy; every source key must be consumed."""
    checkpoint = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    out = convert(checkpoint)
    if convert is convert_flux_transformer_checkpoint_to_diffusers:
        assert not checkpoint, f"diffusers left keys unconverted: {sorted(checkpoint)}"
    return out


# ------------------------------------------------------------------------------------------------ FLUX


def bfl_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """A BFL ``Flux`` state dict's keys and shapes (src/flux/model.py, modules/layers.py)."""
    e, mlp, c = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio), cfg.in_channels
    head = e // cfg.num_heads
    linear = lambda name, n_out, n_in: {f"{name}.weight": (n_out, n_in), f"{name}.bias": (n_out,)}
    embedder = lambda name, n_in: linear(f"{name}.in_layer", e, n_in) | linear(f"{name}.out_layer", e, e)
    shapes = linear("img_in", e, c) | linear("txt_in", e, cfg.context_in_dim)
    shapes |= embedder("time_in", 256) | embedder("vector_in", cfg.vec_in_dim)
    if cfg.guidance_embed:
        shapes |= embedder("guidance_in", 256)
    for i in range(cfg.depth):
        b = f"double_blocks.{i}"
        for stream in ("img", "txt"):
            shapes |= linear(f"{b}.{stream}_mod.lin", 6 * e, e)
            shapes |= linear(f"{b}.{stream}_attn.qkv", 3 * e, e) | linear(f"{b}.{stream}_attn.proj", e, e)
            shapes[f"{b}.{stream}_attn.norm.query_norm.scale"] = (head,)
            shapes[f"{b}.{stream}_attn.norm.key_norm.scale"] = (head,)
            shapes |= linear(f"{b}.{stream}_mlp.0", mlp, e) | linear(f"{b}.{stream}_mlp.2", e, mlp)
    for i in range(cfg.depth_single_blocks):
        b = f"single_blocks.{i}"
        shapes |= linear(f"{b}.modulation.lin", 3 * e, e)
        shapes |= linear(f"{b}.linear1", 3 * e + mlp, e) | linear(f"{b}.linear2", e, e + mlp)
        shapes[f"{b}.norm.query_norm.scale"] = (head,)
        shapes[f"{b}.norm.key_norm.scale"] = (head,)
    shapes |= linear("final_layer.adaLN_modulation.1", 2 * e, e) | linear("final_layer.linear", c, e)
    return shapes


def _to_full_width(bfl: dict[str, np.ndarray], e: int, mlp: int) -> dict[str, np.ndarray]:
    """Each linear1 segment (E, E, E, MLP rows) at the start of diffusers' full-width slot, zeros after."""
    out = dict(bfl)
    for k, v in bfl.items():
        if ".linear1." in k:
            wide = np.zeros((sum(FULL_WIDTH_SEGMENTS), *v.shape[1:]), v.dtype)
            src, dst = 0, 0
            for n, slot in zip((e, e, e, mlp), FULL_WIDTH_SEGMENTS, strict=True):
                wide[dst : dst + n] = v[src : src + n]
                src, dst = src + n, dst + slot
            out[k] = wide
    return out


def _from_full_width(sd: dict[str, torch.Tensor], e: int, mlp: int) -> dict[str, np.ndarray]:
    """Cuts the split linear1 pieces back to the tiny widths (the rest must be the zeros put there)."""
    out = {}
    for k, v in sd.items():
        v = v.numpy()
        if k.startswith("single_transformer_blocks.") and (".attn.to_" in k or ".proj_mlp." in k):
            n = mlp if ".proj_mlp." in k else e
            assert not v[n:].any(), k
            v = v[:n]
        out[k] = v
    return out


def _flux_diffusers_state(bfl: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    e, mlp = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio)
    converted = _converted(convert_flux_transformer_checkpoint_to_diffusers, _to_full_width(bfl, e, mlp))
    return _from_full_width(converted, e, mlp)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux_bfl_reader_agrees_with_diffusers_converter(tmp_path, guidance):
    cfg = flux_tiny.config(guidance)
    bfl = _random(bfl_shapes(cfg), seed=1)
    direct = _params(write_safetensors(tmp_path / "bfl.safetensors", bfl), config=cfg)

    model = FluxTransformer2DModel(**flux_tiny.model(guidance).config)
    sd = _flux_diffusers_state(bfl, cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    model.save_pretrained(tmp_path / "diffusers")
    _assert_same(direct, _params(tmp_path / "diffusers"))


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux_bfl_writer_is_read_back_by_diffusers_converter(tmp_path, guidance):
    cfg, want = flux_tiny.config(guidance), flux_tiny.state_dict(guidance)
    bfl = load_file(write_bfl(cfg, want, tmp_path / "flux.safetensors"))
    assert {k: v.shape for k, v in bfl.items()} == bfl_shapes(cfg)
    _assert_same(_flux_diffusers_state(bfl, cfg), want)


# ------------------------------------------------------------------------------------------------- Wan


def original_wan_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """An original ``WanModel`` state dict's keys and shapes (wan/modules/model.py)."""
    d, f = cfg.dim, cfg.ffn_dim
    linear = lambda name, n_out, n_in: {f"{name}.weight": (n_out, n_in), f"{name}.bias": (n_out,)}
    affine = lambda name, n: {f"{name}.weight": (n,), f"{name}.bias": (n,)}
    shapes = {"patch_embedding.weight": (d, cfg.in_channels, *cfg.patch_size), "patch_embedding.bias": (d,)}
    shapes |= linear("text_embedding.0", d, cfg.text_dim) | linear("text_embedding.2", d, d)
    shapes |= linear("time_embedding.0", d, cfg.freq_dim) | linear("time_embedding.2", d, d)
    shapes |= linear("time_projection.1", 6 * d, d)
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        shapes[f"{b}.modulation"] = (1, 6, d)
        for attn in ("self_attn", "cross_attn"):
            for part in "qkvo":
                shapes |= linear(f"{b}.{attn}.{part}", d, d)
            shapes[f"{b}.{attn}.norm_q.weight"] = (d,)
            shapes[f"{b}.{attn}.norm_k.weight"] = (d,)
        if cfg.is_i2v:
            shapes |= linear(f"{b}.cross_attn.k_img", d, d) | linear(f"{b}.cross_attn.v_img", d, d)
            shapes[f"{b}.cross_attn.norm_k_img.weight"] = (d,)
        shapes |= affine(f"{b}.norm3", d)
        shapes |= linear(f"{b}.ffn.0", f, d) | linear(f"{b}.ffn.2", d, f)
    shapes["head.modulation"] = (1, 2, d)
    shapes |= linear("head.head", cfg.out_channels * int(np.prod(cfg.patch_size)), d)
    if cfg.is_i2v:
        image = wan_tiny.IMAGE_DIM
        shapes |= affine("img_emb.proj.0", image) | linear("img_emb.proj.1", image, image)
        shapes |= linear("img_emb.proj.3", d, image) | affine("img_emb.proj.4", d)
    return shapes


def _original_config_json(cfg) -> dict:
    """The ``config.json`` of Wan-AI's original repositories (``WanModel``'s arguments)."""
    return {
        "_class_name": "WanModel",
        "model_type": "i2v" if cfg.is_i2v else "t2v",
        "dim": cfg.dim,
        "ffn_dim": cfg.ffn_dim,
        "num_heads": cfg.num_heads,
        "num_layers": cfg.num_layers,
        "in_dim": cfg.in_channels,
        "out_dim": cfg.out_channels,
        "text_dim": cfg.text_dim,
        "freq_dim": cfg.freq_dim,
        "eps": cfg.eps,
        "text_len": 512,
    }


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_wan_original_reader_agrees_with_diffusers_converter(tmp_path, i2v):
    cfg = wan_tiny.config(i2v)
    original = _random(original_wan_shapes(cfg), seed=2)
    folder = tmp_path / "original"
    write_safetensors(folder / "diffusion_pytorch_model.safetensors", original)
    (folder / "config.json").write_text(json.dumps(_original_config_json(cfg)))
    direct = _params(folder)

    model = WanTransformer3DModel(**wan_tiny.model(i2v).config)
    converted = _converted(convert_wan_transformer_to_diffusers, original)
    model.load_state_dict(converted, strict=True)
    model.save_pretrained(tmp_path / "diffusers")
    _assert_same(direct, _params(tmp_path / "diffusers"))


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_wan_original_writer_is_read_back_by_diffusers_converter(tmp_path, i2v):
    cfg, want = wan_tiny.config(i2v), wan_tiny.state_dict(i2v)
    folder = write_original(cfg, want, tmp_path / "original", shards=2)
    original = {}
    for file in sorted(folder.glob("*.safetensors")):
        original |= load_file(file)
    assert {k: v.shape for k, v in original.items()} == original_wan_shapes(cfg)
    converted = _converted(convert_wan_transformer_to_diffusers, original)
    _assert_same({k: v.numpy() for k, v in converted.items()}, want)
