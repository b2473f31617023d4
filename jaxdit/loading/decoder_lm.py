"""A decoder-LM text encoder from a transformers folder, on one device or sharded over a mesh.

The tensors are read through ``converters/decoder_lm.py`` (strict key table, vision tower skipped) and
placed straight into their shardings: on a mesh each device reads only its own slice of each memory-mapped
tensor (heads and MLP split over ``tensor`` by ``sharding_rules.decoder_lm``), on one device the whole.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from converters.checks import check_compute_dtype
from converters.decoder_lm import open_decoder_lm
from converters.keymap import place_params
from jaxdit.mesh import single_device_mesh
from jaxdit.models.partitioning import named_shardings
from jaxdit.text_encoders.common import default_dtype, resolve_device
from jaxdit.text_encoders.decoder_lm import DecoderLM, abstract_model, check_tensor_degree
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig
from sharding_rules.decoder_lm import decoder_lm_rules

__all__ = ["load_decoder_lm"]


def load_decoder_lm(
    path: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    device: jax.Device | None = None,
    dtype: Any = None,
    config: DecoderLMConfig | None = None,
    layers: int | None = None,
) -> DecoderLM:
    """The encoder of the folder at ``path`` with its weights on ``mesh`` (sharded by the rule table) or,
    without a mesh, on ``device`` (default: the first local device). ``dtype`` defaults to the stored one
    (float16 widened to float32). ``layers``: only the first ``layers`` decoder layers are read (for
    features taken from hidden states before the last layer)."""
    check_compute_dtype(dtype)
    if mesh is not None and device is not None:
        raise ValueError("give the encoder a mesh or a device, not both")
    opened = open_decoder_lm(path, config, layers=layers)
    cfg = opened.config
    if mesh is not None:
        check_tensor_degree(cfg, int(mesh.shape["tensor"]))
    else:
        mesh = single_device_mesh(resolve_device(device))
    dtype = dtype if dtype is not None else default_dtype(opened.dtype)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    flat = nnx.to_flat_state(abstract)
    key = lambda p: ".".join(map(str, p))  # noqa: E731
    lazies = opened.resolve({key(p): tuple(v.shape) for p, v in flat})
    rules = decoder_lm_rules(int(mesh.shape["tensor"]))
    shardings = {key(p): s.get_value() for p, s in nnx.to_flat_state(named_shardings(abstract, rules, mesh))}
    arrays = place_params(lazies, shardings, dtype)
    return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(arrays[key(p)])) for p, v in flat]))
