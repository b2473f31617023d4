"""Which backend computes a local attention call: decided at trace time, from the platform, dtype and
head dimension, never per call at run time.

``auto`` is cuDNN on NVIDIA GPUs for float16/bfloat16 (then the Triton kernel if cuDNN cannot serve),
splash attention on TPUs, and the XLA kernel otherwise (CPUs, float32 anywhere, ROCm). An explicitly
requested backend that cannot serve a call (wrong platform, dtype or head dimension, cuDNN missing) falls
back along cudnn -> triton -> xla (splash -> xla) with ONE warning per distinct reason, naming the reason
and the backend used instead; it never crashes for want of a kernel.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxdit.parallel.kernels import cudnn, splash, triton

#: Every backend, in no order of preference.
BACKENDS = ("xla", "cudnn", "triton", "splash")
#: What ``attention_backend`` accepts.
CHOICES = ("auto", *BACKENDS)
#: Keys of a model's ``kernel`` options (``ShardContext.kernel``): the backend, the XLA kernel's tiles,
#: Pallas interpret mode (runs the Pallas kernels on any platform, for tests) and the platform the
#: program is lowered for (default: jax's default backend; "cuda" lowers for a GPU from a CPU host).
KERNEL_OPTIONS = ("backend", "block_q", "block_k", "interpret", "platform")
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

#: Where a backend that cannot serve a call hands it.
_FALLBACK = {"cudnn": "triton", "triton": "xla", "splash": "xla"}


class KernelFallbackWarning(UserWarning):
    """A requested attention backend cannot serve a call; another one computes it."""


class Choice(NamedTuple):
    """The backend that computes a call, and why it is not the one asked for (None when it is)."""

    backend: str
    reason: str | None = None


def check_backend(name: str) -> str:
    if name not in CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(CHOICES)}")
    return name


def check_kernel_options(options: Mapping[str, Any] | None) -> None:
    """Raise ValueError for unknown keys or values of a ``kernel`` mapping (before anything compiles)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(KERNEL_OPTIONS))
    if unknown:
        raise ValueError(f"unknown kernel options {unknown}; valid: {', '.join(KERNEL_OPTIONS)}")
    check_backend(options.get("backend", "auto"))
    for tile in ("block_q", "block_k"):
        if tile in options and (not isinstance(options[tile], int) or options[tile] < 1):
            raise ValueError(f"kernel option {tile} must be a positive int, got {options[tile]!r}")
    if options.get("platform") is not None:
        platform_name(options["platform"])


def with_backend(kernel: Mapping[str, Any] | None, backend: str | None) -> dict[str, Any] | None:
    """``kernel`` options with ``backend`` set (``attention_backend=`` arguments); None leaves them as they
    are. Validated."""
    if backend is not None:
        kernel = {**(kernel or {}), "backend": backend}
    check_kernel_options(kernel)
    return None if kernel is None else dict(kernel)


def platform_name(platform: str | None = None) -> str:
    """cpu / cuda / rocm / tpu: ``platform`` (``gpu`` resolved from the local GPU, else cuda), or jax's
    default backend's."""
    name = (platform or jax.default_backend()).lower()
    if name == "gpu":
        try:
            version = jax.devices("gpu")[0].client.platform_version.lower()
            name = "rocm" if "rocm" in version else "cuda"
        except RuntimeError:
            name = "cuda"
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; valid: {', '.join(PLATFORMS)} (or gpu)")
    return name


def unsupported(backend: str, platform: str, dtype, head_dim: int, interpret: bool = False) -> str | None:
    """Why ``backend`` cannot compute attention for this platform, dtype and head dimension, or None."""
    if backend == "xla":
        return None
    if backend == "cudnn":
        if platform != "cuda":
            return f"cuDNN runs on NVIDIA GPUs, not {platform}"
        return cudnn.unsupported(dtype, head_dim)
    if backend == "triton":
        if platform not in ("cuda", "rocm") and not interpret:
            return f"the Triton kernel runs on GPUs, not {platform} (interpret=True runs it anywhere)"
        return triton.unsupported(dtype, head_dim)
    if backend == "splash":
        if platform != "tpu" and not interpret:
            return f"splash attention runs on TPUs, not {platform} (interpret=True runs it anywhere)"
        return splash.unsupported(dtype, head_dim)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(CHOICES)}")


def _auto(platform: str, dtype) -> str:
    if platform == "cuda" and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16):
        return "cudnn"
    if platform == "tpu":
        return "splash"
    return "xla"


def backend_for(
    platform: str | None,
    dtype,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...] | None = None,
    requested: str = "auto",
    interpret: bool = False,
) -> Choice:
    """The backend that would compute attention of q ``q_shape`` [B, Tq, H, D] over k/v ``k_shape``
    [B, Tk, H, D] in ``dtype`` on ``platform`` (cpu/cuda/gpu/rocm/tpu; None: jax's default backend) when
    ``requested`` is asked for, with the reason it differs from the request (or from auto's first
    choice). Pure: no warning. Shapes matter only through the head dimension today."""
    check_backend(requested)
    platform = platform_name(platform)
    head_dim = q_shape[-1]
    if k_shape is not None and k_shape[-1] != head_dim:
        raise ValueError(f"q and k head dimensions differ: {q_shape} vs {k_shape}")
    backend = _auto(platform, dtype) if requested == "auto" else requested
    reasons = []
    while (reason := unsupported(backend, platform, dtype, head_dim, interpret)) is not None:
        reasons.append(f"{backend}: {reason}")
        backend = _FALLBACK[backend]
    return Choice(backend, "; ".join(reasons) or None)


_warned: set[str] = set()


def choose(
    requested: str,
    platform: str | None,
    dtype,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...] | None = None,
    interpret: bool = False,
) -> str:
    """:func:`backend_for`, warning once per distinct fallback (called while tracing)."""
    choice = backend_for(platform, dtype, q_shape, k_shape, requested, interpret)
    if choice.reason is not None:
        message = (
            f"attention backend {requested!r} cannot serve {jnp.dtype(dtype).name} attention with head_dim "
            f"{q_shape[-1]} on {platform_name(platform)} ({choice.reason}); using {choice.backend!r}"
        )
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, KernelFallbackWarning, stacklevel=3)
    return choice.backend
