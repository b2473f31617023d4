"""Pieces the text and image encoders share: stacked blocks, attention, activations, placement on a device.

Shape letters: B batch, L tokens, H heads, D head_dim, E embed, F MLP hidden.
Precision: weights and matmuls in the encoder's dtype with fp32 accumulation; the residual stream, norms
and softmax in fp32 (the same policy as ``jaxdit/models/layers.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.models import partitioning

PathLike = str | os.PathLike[str]


def read_json(path: PathLike) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activations the encoders use, by their transformers names."""
    if name == "quick_gelu":  # OpenAI CLIP: x * sigmoid(1.702 x)
        return lambda x: x * jax.nn.sigmoid(1.702 * x)
    if name == "gelu":  # erf form
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_tanh"):  # tanh approximation (T5 v1.1 "gated-gelu")
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "relu":
        return jax.nn.relu
    raise ValueError(f"unsupported activation {name!r}; known: quick_gelu, gelu, gelu_new, relu")


def stack_blocks(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """``n`` blocks with a leading layer axis on every parameter (run with :func:`scan_blocks`)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)


def scan_blocks(
    blocks: nnx.Module, carry: Any, step: Callable[[nnx.Module, Any], Any], *, first: int | None = None
):
    """Run the stacked ``blocks`` (the first ``first`` of them, default all) in order with ``lax.scan``: the
    compiled program holds one block whatever the depth."""
    graphdef, state = nnx.split(blocks)
    if first is not None:
        state = jax.tree.map(lambda x: x[:first], state)

    def body(c, block_state):
        return step(nnx.merge(graphdef, block_state), c), None

    carry, _ = jax.lax.scan(body, carry, state)
    return carry


def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, scale: float) -> jax.Array:
    """softmax(scale * q k^T + bias) v with fp32 scores and softmax.

    q, k, v [B, L, H, D]; bias broadcastable to [B, H, L, L] (fp32, large negative where masked).
    Returns [B, L, H * D] in v's dtype.
    """
    s = jnp.einsum("blhd,bmhd->bhlm", q, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        s = s + bias
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhlm,bmhd->blhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(*out.shape[:2], -1).astype(v.dtype)


def heads(x: jax.Array, head_dim: int) -> jax.Array:
    """[B, L, H*D] -> [B, L, H, D]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


#: Added to the scores of masked keys (transformers adds the dtype's minimum; fp32 here).
MASKED = float(np.finfo(np.float32).min)


def default_dtype(stored: np.dtype) -> Any:
    """The compute dtype when the caller gives none: the checkpoint's, except float16 -> float32 (T5 is
    known to overflow in fp16, and jaxdit keeps the residual stream in fp32 anyway)."""
    stored = np.dtype(stored)
    if stored == np.float16 or not jnp.issubdtype(stored, jnp.floating):
        return jnp.float32
    return stored


def resolve_device(device: jax.Device | None) -> jax.Device:
    """The device an encoder runs on: the caller's, else the first local one."""
    if device is None:
        return jax.local_devices()[0]
    if not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device (e.g. jax.devices()[1]), got {device!r}")
    return device


def parameter_shapes(abstract: nnx.Module) -> dict[str, tuple[int, ...]]:
    return partitioning.parameter_shapes(abstract)


def jit_forward(
    model: nnx.Module,
    fn: Callable[..., Any],
    compiler_options: Mapping[str, Any] | None = None,
    *,
    offload: bool = False,
) -> Callable[..., Any]:
    """``fn(model, *args)`` jitted with the model's parameters as an argument (not baked-in constants).

    ``offload``: the parameters leave their device now and wait in host memory; each call copies them
    back, runs, and frees the device copy once the result is ready, so between prompts the device holds
    none of the encoder (the transformer gets the memory). Costs one host-to-device copy per call."""
    graphdef, state = nnx.split(model)
    jitted = jax.jit(
        lambda st, *args: fn(nnx.merge(graphdef, st), *args),
        compiler_options=dict(compiler_options) if compiler_options else None,
    )
    if not offload:
        return lambda *args: jitted(state, *args)
    (device,) = {d for leaf in jax.tree.leaves(state) for d in leaf.devices()}
    host = jax.device_get(state)
    for leaf in jax.tree.leaves(state):
        leaf.delete()  # the module's own references now point at deleted arrays: only ``host`` is used

    def offloaded(*args):
        on_device = jax.device_put(host, device)
        try:
            return jax.block_until_ready(jitted(on_device, *args))
        finally:
            for leaf in jax.tree.leaves(on_device):
                leaf.delete()

    return offloaded


__all__ = [
    "MASKED",
    "activation",
    "attention",
    "default_dtype",
    "heads",
    "jit_forward",
    "parameter_shapes",
    "read_json",
    "resolve_device",
    "scan_blocks",
    "stack_blocks",
]
