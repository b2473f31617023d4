"""Per-device attention kernels behind one contract, and the choice between them.

Every backend computes softmax attention of q [B, Tq, H, D] over k/v [B, Tk, H, D] with an optional
key-valid mask [B, Tk] and returns ``(out [B, Tq, H, D], lse [B, Tq, H] fp32, natural log)``; a query
whose keys are all masked gets out 0 and lse -inf, the identity of Ring's log-sum-exp merge
(``contract.py``). Kernels change compute, never communication: every parallel strategy calls
``jaxdit.parallel.local_attention.local_attention``, which dispatches here.

Backends, one file each:

* ``xla``: blockwise online softmax in plain XLA; runs everywhere; the CPU default and the reference.
* ``cudnn``: cuDNN's fused attention through jax's private fp32-LSE call (NVIDIA GPUs, fp16/bf16);
  key padding anywhere in the sequence by putting valid keys first.
* ``triton``: a Pallas (Triton) FlashAttention-2 forward kernel with a per-key mask (GPUs).
* ``splash``: jax's TPU splash attention with saved residuals (TPUs).

Choosing (``select.py``), for planners and scripts:

* :data:`BACKENDS` lists the backends, :data:`CHOICES` what ``attention_backend`` accepts (``auto`` too).
* :func:`backend_for` ``(platform, dtype, q_shape, k_shape=None, requested="auto", interpret=False,
  assume_present=False)`` returns :class:`Choice` ``(backend, reason)``: the backend that would compute
  such a call, and why it is not the one requested (None when it is). ``auto`` is cuDNN on NVIDIA GPUs
  for fp16/bf16, splash on TPUs, XLA otherwise; a backend that cannot serve falls back cudnn -> triton ->
  xla, splash -> xla. ``assume_present`` judges as on a host with the platform's kernels installed
  (``jaxdit plan``). While tracing, each distinct fallback reason warns once per process
  (:class:`KernelFallbackWarning`); ``auto`` warns only when a kernel is missing from the host (cuDNN
  not detected, jax's private entry point moved or changed), not for shapes no fused kernel takes.
* :func:`check_kernel_options` validates a model's ``kernel`` mapping (keys :data:`KERNEL_OPTIONS`):
  ``backend``, the XLA kernel's ``block_q``/``block_k`` tiles, ``interpret`` (run the Pallas kernels in
  the interpreter on any platform) and ``platform`` (the platform lowered for, e.g. "cuda" on a CPU host);
  :func:`with_backend` merges an ``attention_backend=`` argument into such a mapping.
"""

from jaxdit.parallel.kernels.select import (
    BACKENDS,
    CHOICES,
    KERNEL_OPTIONS,
    Choice,
    KernelFallbackWarning,
    backend_for,
    check_backend,
    check_kernel_options,
    choose,
    platform_name,
    with_backend,
)

__all__ = [
    "BACKENDS",
    "CHOICES",
    "KERNEL_OPTIONS",
    "Choice",
    "KernelFallbackWarning",
    "backend_for",
    "check_backend",
    "check_kernel_options",
    "choose",
    "platform_name",
    "with_backend",
]
