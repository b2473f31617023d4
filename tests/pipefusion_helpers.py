"""What the PipeFusion tests of every family share: meshes, collectives of a compiled program and the
serial reference's attention with stale K/V (tests/test_pipefusion.py, tests/test_pipefusion_wan.py), and
its host-planned cache state (tests/test_cache_pipefusion.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

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


class TaylorResiduals:
    """A serial reference's host-planned cache state (``jaxdit.pipelines.pipefusion.cache``): per patch,
    the residual of all blocks at its last full step and (``order`` > 0) TaylorSeer's finite differences
    D_0 = the residual, D_{i+1} = (D_i - D_i(previous)) / gap, zero until ``i + 1`` full steps are in."""

    def __init__(self, patches: int, order: int):
        self.order, self.derivatives = order, [None] * patches

    def refresh(self, m, residual, gap: int, full_before: int) -> None:
        old, new = self.derivatives[m], [residual]
        for i in range(self.order):
            new.append((new[i] - old[i]) / max(gap, 1) if full_before > i else jnp.zeros_like(residual))
        self.derivatives[m] = new

    def forecast(self, m, k: int):
        """Patch ``m``'s residual ``k`` steps after its last full step (order 0: the residual itself)."""
        return sum(d * (k**i / math.factorial(i)) for i, d in enumerate(self.derivatives[m]))


#: Made-up MagCache ratios of 6 steps (the tiny random models ship none): at threshold 0.5 they skip
#: steps 1, 2, 4 and 5 after one warm-up step, the plan the 6-step PipeFusion cache tests expect.
SIX_STEP_RATIOS = (1.0, 0.99, 0.98, 0.97, 0.96, 0.95)


def six_step_cache(name: str, folder, branches: int = 1):
    """(cache, Taylor order) of the 6-step PipeFusion cache tests: MagCache 0.5 on :data:`SIX_STEP_RATIOS`
    (saved under ``folder``, one row per guidance branch) or TaylorSeer interval 2, order 1, one warm-up."""
    from jaxdit.cache import MagCache, TaylorSeer, magcache

    if name == "magcache":
        path = str(folder / "ratios.json")
        magcache.save_ratios(path, np.asarray([SIX_STEP_RATIOS] * branches))
        return MagCache(threshold=0.5, ratios=path), 0
    return TaylorSeer(interval=2, order=1, warmup=1), 1
