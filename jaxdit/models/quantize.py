"""FP8 weights for a model: which linear layers are quantized, and the in-place swap.

What is quantized: the linear layers of the block stacks (``STACKS``), where nearly all of a diffusion
transformer's weights and FLOPs are. What stays in the model's dtype: the embedders and the output head
(small, and the first and last word on every token), every layer whose output axis is ``"modulation"``
(AdaLN shift/scale/gate: an error there scales a whole stream), and the layers under ``keep``: dotted path
parts such as ``"img_mlp"``, by default the model's own ``FP8_KEEP`` (a family declares the layers known
to lose quality in FP8 on its model class; Qwen-Image keeps its image-stream MLP). Norms, RoPE, softmax
statistics and the sampler are not linear layers and never were in FP8.

:class:`FP8` is how a caller asks for it (``load_model(..., fp8=FP8(...))``, or just the mode's name):
the mode, the keep list, and ``skip_steps``: the first and last that many denoising steps run on the
original weights, which :func:`quantize_model` then retains beside the FP8 ones (:func:`retained`).

Works on loaded models (arrays on a mesh keep their shardings; the scales are laid out like the kernel's
output axis) and on abstract ones (``jax.ShapeDtypeStruct`` leaves), so the planner and the memory tables
price the same parameters a run holds.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdit.models import fp8
from jaxdit.models.layers import Linear

__all__ = ["FP8", "Retained", "as_fp8", "fp8_layers", "is_quantized", "quantize_model", "retained"]

_quantize = jax.jit(fp8.quantize_kernel)


@dataclasses.dataclass(frozen=True)
class FP8:
    """FP8 weights as a run asks for them.

    ``mode``: ``"weight"`` or ``"matmul"`` (``jaxdit.models.fp8``). ``keep``: dotted path parts of the
    block layers left in the model's dtype; None: the model's ``FP8_KEEP``; ``()``: none. ``skip_steps``:
    the first and the last ``skip_steps`` denoising steps run with the original (bf16) weights, retained
    on the devices beside the FP8 ones (xDiT keeps its high-precision layers the same way)."""

    mode: str = "weight"
    keep: tuple[str, ...] | None = None
    skip_steps: int = 0

    def __post_init__(self) -> None:
        if self.mode not in fp8.MODES:
            raise ValueError(f"fp8 mode {self.mode!r}: expected one of {', '.join(fp8.MODES)}")
        if isinstance(self.skip_steps, bool) or not isinstance(self.skip_steps, int) or self.skip_steps < 0:
            raise ValueError(f"fp8 skip_steps must be an integer >= 0, got {self.skip_steps!r}")


def as_fp8(fp8_option: str | FP8 | None) -> FP8 | None:
    """``fp8=`` as the loaders take it: a mode's name, an :class:`FP8`, or None (no FP8)."""
    return FP8(fp8_option) if isinstance(fp8_option, str) else fp8_option


@dataclasses.dataclass(frozen=True)
class Retained:
    """The original weights of a model quantized with ``skip_steps`` (see :class:`FP8`)."""

    original: nnx.Module
    skip_steps: int


# Keyed by the quantized model object: the original is not part of its graph (an nnx attribute would be),
# so the FP8 forward's parameters and compiled program stay exactly those of a plain FP8 model.
_RETAINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def retained(model: nnx.Module) -> Retained | None:
    """The original weights :func:`quantize_model` kept for ``model`` (``skip_steps > 0``), or None."""
    return _RETAINED.get(model)


def _kept(name: str, keep: Sequence[str]) -> bool:
    # Whole dotted parts: "img_mlp" keeps transformer_blocks.img_mlp.proj, "mlp" alone keeps nothing there.
    return any(f".{k}." in f".{name}." for k in keep)


def fp8_layers(model: nnx.Module, keep: Sequence[str] | None = None) -> Iterator[tuple[str, Linear]]:
    """(dotted path, layer) of every linear layer :func:`quantize_model` turns to FP8; ``keep``: see
    :class:`FP8` (None: the model's ``FP8_KEEP``)."""
    stacks = tuple(getattr(model, "STACKS", ()))
    keep = tuple(getattr(model, "FP8_KEEP", ())) if keep is None else tuple(keep)
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Linear) or not path or path[0] not in stacks:
            continue
        name = ".".join(map(str, path))
        if "modulation" in module.kernel.logical_axes or _kept(name, keep):
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


def quantize_model(
    model: nnx.Module, mode: str, keep: Sequence[str] | None = None, *, skip_steps: int = 0
) -> int:
    """Turn the block stacks' linear layers of ``model`` to FP8 in place (see the module docstring);
    ``mode``: ``"weight"`` or ``"matmul"`` (``jaxdit.models.fp8``); ``keep``, ``skip_steps``: see
    :class:`FP8` (with ``skip_steps`` the original weights stay alive, :func:`retained`). Returns the
    number of layers quantized."""
    FP8(mode, None if keep is None else tuple(keep), skip_steps)  # checks the arguments
    if is_quantized(model):
        raise ValueError("the model's weights are FP8 already")
    if skip_steps:
        # A second view of the same arrays (nothing is copied); the swap below leaves them to it alone.
        _RETAINED[model] = Retained(nnx.clone(model), skip_steps)
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
