"""Which backend computes a local attention call: decided at trace time, from the platform, dtype and
head dimension, never per call at run time.

``auto`` is cuDNN on NVIDIA GPUs for float16/bfloat16 (then the Triton kernel if cuDNN cannot serve),
splash attention on TPUs, and the XLA kernel otherwise (CPUs, float32 anywhere, ROCm). An explicitly
requested backend that cannot serve a call (wrong platform, dtype or head dimension, cuDNN missing) falls
back along cudnn -> triton -> xla (splash -> xla) with ONE warning per distinct reason, naming the reason
and the backend used instead; it never crashes for want of a kernel. float32 asked of cuDNN on a GPU goes
to XLA, not to the Triton kernel, whose fp32 matmuls run in TF32. cuDNN counts as missing when a tiny
fused call fails its once-per-process probe on the local GPU (``cudnn.probe_failure``). ``auto`` warns only when a kernel it
would use is missing from the host (cuDNN not detected, jax's entry point moved): a shape or dtype no fused
kernel takes (the VAEs' single 512- or 384-wide head, float32) is simply computed by XLA.
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
            version = str(jax.devices("gpu")[0].client.platform_version).lower()
            name = "rocm" if "rocm" in version else "cuda"
        except Exception:  # noqa: BLE001 - no GPU client to ask (lowering from another host): cuda
            name = "cuda"
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; valid: {', '.join(PLATFORMS)} (or gpu)")
    return name


# Kinds of refusal: the platform is not the kernel's, the dtype or head dimension is past its limits, or
# the platform is right but the kernel is missing from this host (only the last makes ``auto`` warn).
PLATFORM, LIMIT, MISSING = "platform", "limit", "missing"
#: cuDNN's head_dim limit on the GPU ``assume_present`` models (Hopper and newer).
MODELLED_MAX_HEAD = 256


def _refusal(
    backend: str, platform: str, dtype, head_dim: int, interpret: bool, assume_present: bool
) -> tuple[str, str] | None:
    """(kind, reason) why ``backend`` cannot compute this call, or None."""
    if backend == "xla":
        return None
    if backend == "cudnn":
        if platform != "cuda":
            return PLATFORM, f"cuDNN runs on NVIDIA GPUs, not {platform}"
        # A modelled host (the planner) is a Hopper GPU, and asking jax for the local one would start its
        # backend (jaxdit plan --verify has to set the device count first).
        if (why := cudnn.limits(dtype, head_dim, MODELLED_MAX_HEAD if assume_present else None)) is not None:
            return LIMIT, why
        return None if assume_present or (why := cudnn.missing()) is None else (MISSING, why)
    if backend == "triton":
        if platform not in ("cuda", "rocm") and not interpret:
            return (
                PLATFORM,
                f"the Triton kernel runs on GPUs, not {platform} (interpret=True runs it anywhere)",
            )
        if (why := triton.unsupported(dtype, head_dim)) is not None:
            return LIMIT, why
        if interpret or assume_present or (why := triton.missing()) is None:
            return None
        return MISSING, why
    if backend == "splash":
        if platform != "tpu" and not interpret:
            return (
                PLATFORM,
                f"splash attention runs on TPUs, not {platform} (interpret=True runs it anywhere)",
            )
        why = splash.unsupported(dtype, head_dim)
        return None if why is None else (LIMIT, why)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(CHOICES)}")


def unsupported(backend: str, platform: str, dtype, head_dim: int, interpret: bool = False) -> str | None:
    """Why ``backend`` cannot compute attention for this platform, dtype and head dimension, or None."""
    refusal = _refusal(backend, platform, dtype, head_dim, interpret, False)
    return None if refusal is None else refusal[1]


def _auto(platform: str, dtype) -> str:
    if platform == "cuda" and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16):
        return "cudnn"
    if platform == "tpu":
        return "splash"
    return "xla"


def _resolve(
    platform: str | None,
    dtype,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...] | None,
    requested: str,
    interpret: bool,
    assume_present: bool,
) -> tuple[str, list[tuple[str, str]]]:
    """(backend, [(kind, "backend: reason")] of each backend passed over on the way)."""
    check_backend(requested)
    platform = platform_name(platform)
    head_dim = q_shape[-1]
    if k_shape is not None and k_shape[-1] != head_dim:
        raise ValueError(f"q and k head dimensions differ: {q_shape} vs {k_shape}")
    backend = _auto(platform, dtype) if requested == "auto" else requested
    refusals = []
    while (refusal := _refusal(backend, platform, dtype, head_dim, interpret, assume_present)) is not None:
        refusals.append((refusal[0], f"{backend}: {refusal[1]}"))
        if backend == "cudnn" and platform == "cuda" and jnp.dtype(dtype) == jnp.float32:
            # The Triton kernel's fp32 matmuls run in TF32 on NVIDIA GPUs: an fp32 request for a fused
            # kernel gets exact fp32 (XLA), not a lower precision under the fp32 label.
            refusals.append((LIMIT, "triton: skipped for float32 (its matmuls would run in TF32)"))
            backend = "xla"
            continue
        backend = _FALLBACK[backend]
    return backend, refusals


def backend_for(
    platform: str | None,
    dtype,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...] | None = None,
    requested: str = "auto",
    interpret: bool = False,
    assume_present: bool = False,
) -> Choice:
    """The backend that would compute attention of q ``q_shape`` [B, Tq, H, D] over k/v ``k_shape``
    [B, Tk, H, D] in ``dtype`` on ``platform`` (cpu/cuda/gpu/rocm/tpu; None: jax's default backend) when
    ``requested`` is asked for, with the reason it differs from the request (or from auto's first
    choice). Pure: no warning. Shapes matter only through the head dimension today.

    ``assume_present``: judge as on a host of that platform with its kernels installed (cuDNN found,
    jax's Pallas GPU backend importable), whatever this host has: what ``jaxdit plan`` models.
    """
    backend, refusals = _resolve(platform, dtype, q_shape, k_shape, requested, interpret, assume_present)
    return Choice(backend, "; ".join(reason for _, reason in refusals) or None)


_warned: set[tuple[str, str, str]] = set()


def choose(
    requested: str,
    platform: str | None,
    dtype,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...] | None = None,
    interpret: bool = False,
) -> str:
    """:func:`backend_for`, warning once per distinct fallback (called while tracing).

    Once per (request, reason, backend used) in a process: a model whose layers all fall back the same
    way, or a program traced again, warns once. ``auto`` warns only when a kernel is missing from the
    host; its fallbacks for a dtype or head dimension no fused kernel takes are its design, not news.
    """
    backend, refusals = _resolve(platform, dtype, q_shape, k_shape, requested, interpret, False)
    if not refusals or (requested == "auto" and all(kind != MISSING for kind, _ in refusals)):
        return backend
    reason = "; ".join(why for _, why in refusals)
    key = (requested, reason, backend)
    if key not in _warned:
        _warned.add(key)
        message = (
            f"attention backend {requested!r} cannot serve {jnp.dtype(dtype).name} attention with head_dim "
            f"{q_shape[-1]} on {platform_name(platform)} ({reason}); using {backend!r}"
        )
        warnings.warn(message, KernelFallbackWarning, stacklevel=3)
    return backend
