"""FP8 weights for a model: which linear layers are quantized, and the in-place swap.

What is quantized: the linear layers of the block stacks (``STACKS``), where nearly all of a diffusion
transformer's weights and FLOPs are. What stays in the model's dtype: the embedders and the output head
(small, and the first and last word on every token), every layer whose output axis is ``"modulation"``
(AdaLN shift/scale/gate: an error there scales a whole stream), and any layer a caller names in ``keep``
(a path fragment such as ``"img_mlp"``). Norms, RoPE, softmax statistics and the sampler are not linear
layers and never were in FP8.

Works on loaded models (arrays on a mesh keep their shardings; the scales are laid out like the kernel's
output axis) and on abstract ones (``jax.ShapeDtypeStruct`` leaves), so the planner and the memory tables
price the same parameters a run holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.models import fp8
from jaxdit.models.layers import Linear

__all__ = ["fp8_layers", "is_quantized", "quantize_model"]

_quantize = jax.jit(fp8.quantize_kernel)


def fp8_layers(model: nnx.Module, keep: Sequence[str] = ()) -> Iterator[tuple[str, Linear]]:
    """(dotted path, layer) of every linear layer :func:`quantize_model` turns to FP8."""
    stacks = tuple(getattr(model, "STACKS", ()))
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Linear) or not path or path[0] not in stacks:
            continue
        name = ".".join(map(str, path))
        if "modulation" in module.kernel.logical_axes or any(k in name for k in keep):
            continue
        yield name, module


def is_quantized(model: nnx.Module) -> bool:
    return any(isinstance(m, Linear) and m.kernel_scale is not None for _, m in nnx.iter_modules(model))


def _scale_sharding(kernel: jax.Array) -> NamedSharding | None:
    sharding = getattr(kernel, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1]))


def _quantized(kernel) -> tuple:
    if isinstance(kernel, jax.ShapeDtypeStruct):
        q, scale = jax.eval_shape(fp8.quantize_kernel, kernel)
        return (
            jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=kernel.sharding),
            jax.ShapeDtypeStruct(scale.shape, scale.dtype, sharding=_scale_sharding(kernel)),
        )
    q, scale = _quantize(kernel)
    target = _scale_sharding(kernel)
    return q, scale if target is None else jax.device_put(scale, target)


def quantize_model(model: nnx.Module, mode: str, keep: Sequence[str] = ()) -> int:
    """Turn the block stacks' linear layers of ``model`` to FP8 in place (see the module docstring);
    ``mode``: ``"weight"`` or ``"matmul"`` (``jaxdit.models.fp8``). Returns the number of layers."""
    if mode not in fp8.MODES:
        raise ValueError(f"fp8 mode {mode!r}: expected one of {', '.join(fp8.MODES)}")
    if is_quantized(model):
        raise ValueError("the model's weights are FP8 already")
    count = 0
    for _, layer in list(fp8_layers(model, keep)):
        kernel = layer.kernel.get_value()
        axes = tuple(layer.kernel.logical_axes)
        q, scale = _quantized(kernel)
        layer.compute_dtype = jnp.dtype(kernel.dtype)
        layer.kernel = nnx.Param(q, logical_axes=axes)
        layer.kernel_scale = nnx.Param(scale, logical_axes=axes[:-2] + axes[-1:])
        layer.fp8_mode = mode
        count += 1
    return count
