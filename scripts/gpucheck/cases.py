"""The attention shapes one device sees after Ulysses, and the keys naming gpu_check's rows."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """The attention one device computes after Ulysses' all-to-all over ``degree`` sequence shards."""

    name: str
    lengths: tuple[int, ...]  # global token groups (FLUX: text, image)
    degree: int  # ulysses (x ring) shards the layout pads for
    heads: int  # heads on the device (H / U)
    head_dim: int = 128
    batch: int = 1

    def key_valid(self):
        """[T] bool in the order the device holds the tokens: shard by shard, each shard's groups joined,
        each group padded to a multiple of the degree (``jaxdit.parallel.layout``)."""
        import numpy as np

        local = [math.ceil(n / self.degree) for n in self.lengths]
        parts = [
            s * n_local + np.arange(n_local) < n
            for s in range(self.degree)
            for n, n_local in zip(self.lengths, local, strict=True)
        ]
        return np.concatenate(parts)

    def flops(self) -> float:
        t = len(self.key_valid())
        return 4.0 * self.batch * self.heads * t * t * self.head_dim


CASES = (
    AttentionCase("flux-dev 1024px, ulysses6", (512, 4096), 6, 4),
    AttentionCase("wan2.1-1.3b 480p x 81, cfg2 x ulysses4", (32_760,), 4, 3),
    AttentionCase("wan2.1-14b 720p x 81, ulysses8", (75_600,), 8, 5),
)
TINY_CASES = (
    AttentionCase("flux-tiny, ulysses3", (5, 30), 3, 2, head_dim=16),
    AttentionCase("wan-tiny, ulysses2", (60,), 2, 2, head_dim=16),
    AttentionCase("wan-tiny, ulysses4", (75,), 4, 1, head_dim=16),
)


def row_key(part: str, name: str, backend: str) -> str:
    """One row's identity: part (attention / step), case or model, backend."""
    return f"{part}|{name}|{backend}"


def _row_fields(key: str) -> dict:
    part, name, backend = key.split("|")
    return {"part": part, ("case" if part == "attention" else "model"): name, "backend": backend, "key": key}
