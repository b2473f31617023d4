"""What the PipeFusion tests of every family share: meshes, collectives of a compiled program and the
serial reference's attention with stale K/V (tests/test_pipefusion.py, tests/test_pipefusion_wan.py)."""

import jax
import jax.numpy as jnp

from jaxdit import hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.local_attention import reference_attention


def make_mesh(**degrees):
    config = ParallelConfig(**degrees)
    return config.make_mesh(jax.devices()[: config.num_devices])


def collectives(fn_args) -> dict[str, tuple[int, int]]:
    """kind -> (count per run, bytes per device per run) of a compiled program ((fn, args) or a Lowered)."""
    fn, args = fn_args
    out = {}
    for c in hlo_stats.collectives((fn.lower(*args) if args else fn).compile()):
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + c.count, b + c.count * c.bytes_sent_per_device)
    return out


class ReferenceContext:
    """Serial PipeFusion attention: a patch's fresh K/V plus the other patches' buffered K/V.

    ``buffers[layer]`` holds the layer's K/V per patch [M, B, L, H, D] (after warm-up: the whole
    sequence's, which the caller splits into patches); ``patch`` None is warm-up. ``layout``: the
    token groups' join/split, for models whose blocks use it (FLUX's [text; image]).
    """

    def __init__(self, buffers, layer, patch, layout=None):
        self.buffers, self.layer, self.patch, self.layout = buffers, layer, patch, layout

    def sum_tensor_parallel(self, x):
        return x

    def backend_options(self):
        return {}  # the default attention kernel for the model's own (cross-)attention calls

    def attention(self, q, k, v):
        if self.patch is None:  # warm-up: the whole sequence, fresh; the caller splits it into patches
            self.buffers[self.layer] = (k, v)
            return reference_attention(q, k, v)
        kb, vb = self.buffers[self.layer]  # [M, B, L, H, D]
        m, patches = self.patch, kb.shape[0]
        flat = lambda b: jnp.moveaxis(b, 0, 1).reshape(b.shape[1], -1, *b.shape[3:])
        others = jnp.repeat(jnp.arange(patches) != m, kb.shape[2])
        valid = jnp.concatenate([jnp.ones(k.shape[1], bool), others])[None]
        out = reference_attention(
            q, jnp.concatenate([k, flat(kb)], 1), jnp.concatenate([v, flat(vb)], 1), valid
        )
        self.buffers[self.layer] = (kb.at[m].set(k), vb.at[m].set(v))
        return out
