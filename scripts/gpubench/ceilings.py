"""The card's measured ceilings, so every later figure is also a fraction of what this card does."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpubench.timing import batched_median


def matmul_tflops(n: int, batch: int = 20) -> float:
    """bf16 [n, n] @ [n, n] (fp32 accumulation) in TFLOP/s."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    seconds = batched_median(f, (a, b), batch=batch)
    return 2.0 * n**3 / seconds / 1e12


def copy_gbps(mib: int, batch: int = 20) -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written (``x + 1`` cannot be elided)."""
    x = jnp.zeros((mib * 2**19,), jnp.bfloat16)  # mib MiB of bf16
    f = jax.jit(lambda x: x + 1)
    seconds = batched_median(f, (x,), batch=batch)
    return 2.0 * x.nbytes / seconds / 1e9


def measure(dry: bool) -> dict:
    n, mib = (256, 4) if dry else (8192, 1024)
    return {"matmul_n": n, "matmul_tflops": matmul_tflops(n), "copy_mib": mib, "copy_gbps": copy_gbps(mib)}
