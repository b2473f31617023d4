"""A serial statement of PipeFusion's pipelined phase (stale K/V) on an unsharded FLUX.2 transformer,
shared by the klein and dev tests (``tests/test_flux2_pipefusion.py``, ``tests/test_flux2_dev_pipefusion.py``),
and on FLUX.1 Kontext's (``tests/test_flux_kontext.py``: the same staged pieces, its own conditioning
vector and RoPE axes): full softmax over the patch's fresh K/V and the other patches' buffered K/V,
nothing of the runner's programs.

The reference runs the steps in order and, within a step, the patches in order: each layer of patch m
reads this step's K/V of the patches before it and the previous step's of those after it, which is the
order the pipeline's schedule gives every layer (a patch re-enters only after the last patch of the
previous step has passed the same layer). The first step is a warm-up step: every patch at once, the
plain forward, each patch's K/V stored. Text and reference tokens are chunked over the patches (each
chunk padded to the same length, pad tokens masked as keys) and carried as context, never stepped; the
guidance input (dev) is the step conditioning's, as the pipeline prepared it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pipefusion_helpers import TaylorResiduals

from jaxdit.models import flux, flux2
from jaxdit.models.layers import rope_angles
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.local_attention import reference_attention


class _Context:
    """Attention of one block call of the reference: the fresh keys ``valid`` [B, L] of the tokens in hand
    plus (a pipelined patch) the other patches' buffered K/V of the same layer."""

    def __init__(self, layout, patches=None, buffer=None, patch=None, valid=None, split=None):
        self.layout, self.patches, self.buffer = layout, patches, buffer
        self.patch, self.valid, self.split = patch, valid, split

    def sum_tensor_parallel(self, x):
        return x

    def attention(self, q, k, v):
        if self.patch is None:  # warm-up: every patch's tokens at once; store each patch's K/V
            self.buffer.update({m: (k[:, i], v[:, i], self.valid[:, i]) for m, i in enumerate(self.split)})
            return reference_attention(q, k, v, self.valid)
        others = [self.buffer[m] for m in range(self.patches) if m != self.patch]
        keys = jnp.concatenate([k, *(o[0] for o in others)], 1)
        values = jnp.concatenate([v, *(o[1] for o in others)], 1)
        mask = jnp.concatenate([self.valid, *(o[2] for o in others)], 1)
        self.buffer[self.patch] = (k, v, self.valid)
        return reference_attention(q, keys, values, mask)


def _conditioning(model, sigma, guidance, context, ids):
    """What every block reads at model time ``sigma`` [B], for positions ``ids``: FLUX.2's step
    conditioning, or FLUX.1's AdaLN vector (time + guidance + pooled text)."""
    if isinstance(model, flux.FluxTransformer):
        vec = model.conditioning(sigma, jnp.asarray(context["pooled_projections"], jnp.float32), guidance)
        return flux.FluxCond(vec, rope_angles(ids, model.config.axes_dim, model.config.theta)[None])
    return flux2.Flux2Cond(*model.step_conditioning(sigma, guidance), model.angles(ids)[None])


def serial_stale_kv(pipe, inputs, patches: int, ran=None, order: int = 0) -> np.ndarray:
    """The final tokens of ``inputs`` (a pipeline's prepared ``DenoiseInputs``) on ``pipe``'s unsharded
    model: one warm-up step, then every later step patch by patch with the other patches' stale K/V.

    ``ran`` (a host-planned cache's plan, ``jaxdit.pipelines.pipefusion.cache``): each full step keeps,
    per patch, the residual of every block on the image tokens (the joined stream's image group minus
    the embedded image, what the output layer reads); a skipped step runs, per patch, the output layer
    on the embedded image plus that residual (``order`` > 0: its Taylor forecast), no block, no K/V write."""
    model, sampler, schedule, ctx_in = pipe.model, pipe.sampler, inputs.schedule, inputs.context
    rows, cols = inputs.grid
    n = rows * cols // patches
    guidance = ctx_in.get("guidance")
    guidance = None if guidance is None else jnp.asarray(guidance, jnp.float32)

    def chunked(name, ids_name):
        """Per-patch chunks of a context group, padded to M chunks (pad tokens masked as keys)."""
        x, ids = np.asarray(ctx_in[name]), np.asarray(ctx_in[ids_name])
        length, chunk = x.shape[1], -(-x.shape[1] // patches)
        pad = patches * chunk - length
        valid = np.arange(patches * chunk) < length
        return np.pad(x, [(0, 0), (0, pad), (0, 0)]), np.pad(ids, [(0, pad), (0, 0)]), valid, chunk

    txt, txt_ids, txt_valid, t = chunked("encoder_hidden_states", "txt_ids")
    ref, ref_ids, ref_valid, r = chunked("reference_hidden_states", "reference_ids")
    img_ids = np.asarray(ctx_in["img_ids"])
    x = np.asarray(inputs.tokens, np.float32)
    batch = x.shape[0]
    buffers: dict = {}
    T, N = patches * t, rows * cols  # noqa: N806
    split = [
        np.concatenate([np.arange(m * t, (m + 1) * t), T + np.arange(m * n, (m + 1) * n),
                        T + N + np.arange(m * r, (m + 1) * r)])
        for m in range(patches)
    ]  # fmt: skip

    def run(patch, x_tokens, step, residual=None):
        """The velocity of ``patch``'s image tokens (None: every patch, the warm-up's full sequence) and
        the blocks' residual on them; ``residual`` given: added to the embedded image, no block run."""
        whole = patch is None
        sel = lambda size, total: np.arange(total) if whole else np.arange(patch * size, (patch + 1) * size)  # noqa: E731
        ts, ns, rs = sel(t, T), sel(n, N), sel(r, patches * r)
        streams = model.embed_tokens(jnp.asarray(x_tokens), jnp.asarray(txt[:, ts]), jnp.asarray(ref[:, rs]))
        sigma = jnp.full((batch,), sampler.model_time(schedule, step), jnp.float32)
        ids = jnp.asarray(np.concatenate([txt_ids[ts], img_ids[ns], ref_ids[rs]]))
        cond = _conditioning(model, sigma, guidance, ctx_in, ids)
        layout = SequenceLayout((len(ts), len(ns), len(rs)), 1)
        valid = np.concatenate([txt_valid[ts], np.ones(len(ns), bool), ref_valid[rs]])
        valid = jnp.asarray(np.broadcast_to(valid, (batch, len(valid))))
        start = streams[1][:, : len(ns)]
        if residual is not None:  # a skipped step: the joined [text; image + residual; reference]
            image, refs = streams[1][:, : len(ns)], streams[1][:, len(ns) :]
            streams = layout.join_local([streams[0], image + residual, refs])
        for stack in model.STACKS if residual is None else ():
            streams = model.enter(stack, streams, _Context(layout))
            graphdef, state = nnx.split(getattr(model, stack))
            for layer in range(jax.tree.leaves(state)[0].shape[0]):
                block = nnx.merge(graphdef, jax.tree.map(lambda a, layer=layer: a[layer], state))
                ctx = _Context(layout, patches, buffers.setdefault((stack, layer), {}), patch, valid, split)
                streams = model.run_block(stack, block, streams, cond, ctx)
        return model.output(streams, cond, _Context(layout)), layout.split_local(streams)[1] - start

    ran = (True,) * inputs.steps if ran is None else ran
    cache = TaylorResiduals(patches, order)
    v, residual = run(None, x, 0)
    x = np.array(sampler.step(schedule, 0, (), jnp.asarray(x), v)[0])
    for m in range(patches):
        cache.refresh(m, residual[:, m * n : (m + 1) * n], 0, 0)
    last, full = 0, 1  # the warm-up step
    for step in range(1, inputs.steps):
        for m in range(patches):
            band = slice(m * n, (m + 1) * n)
            v, residual = run(m, x[:, band], step, None if ran[step] else cache.forecast(m, step - last))
            x[:, band] = np.asarray(sampler.step(schedule, step, (), jnp.asarray(x[:, band]), v)[0])
            if ran[step]:
                cache.refresh(m, residual, step - last, full)
        if ran[step]:
            last, full = step, full + 1
    return x
