"""A serial reference of PipeFusion's stale-K/V semantics for Wan, written on the unsharded model(s),
for every variant: Wan 2.2 A14B's two experts (each expert's run of steps restarts with its own
synchronous warm-up steps, as ``jaxdit.pipelines.pipefusion.segments`` says), I2V's condition channels
and TI2V's first frame and per-token timesteps (tests/test_pipefusion_wan22.py).

It takes the plain pipeline's own inputs (``WanPipeline.prepare(...).inputs``: noise tokens, text, the
per-token extras, the schedule, each step's expert and guidance scale) and, per step, either runs the whole
sequence (a warm-up step: every layer's K/V buffered per patch) or each patch in order against its fresh
K/V and the other patches' latest buffered K/V (``pipefusion_helpers.ReferenceContext``), UniPC on each
patch with its own slice of the sampler state. One request, CFG on (the text rows are [uncond; cond]).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from pipefusion_helpers import ReferenceContext, TaylorResiduals

from jaxdit.models import wan
from jaxdit.models.layers import rope_angles
from jaxdit.pipelines import pipefusion_wan as pw
from jaxdit.pipelines.wan import swap_features
from jaxdit.samplers import unipc


def warmup_steps_of(experts: tuple[int, ...], steps: int, warmup: int) -> list[bool]:
    """Whether each step is synchronous: the first ``warmup`` steps of each run of one expert."""
    runs, first = [], 0
    for i in range(steps):
        if experts and i and experts[i] != experts[i - 1]:
            first = i
        runs.append(i - first < warmup)
    return runs


def stale_kv_reference(
    models: list[wan.WanTransformer],
    inputs,
    patches: int,
    warmup: int,
    patch_by: str = "rows",
    ran: tuple[bool, ...] | None = None,
    order: int = 0,
) -> np.ndarray:
    """The final latent tokens [1, N, K] of PipeFusion's semantics on ``inputs`` (a ``DenoiseInputs``)
    with ``models[e]`` for expert e (one model: every step).

    ``ran`` (a host-planned cache's plan, ``jaxdit.pipelines.pipefusion.cache``): each full step keeps
    per patch the residual of all blocks (their output minus the patch embedding); each skipped step runs,
    per patch, the step's expert's head on the embedding plus the kept residual (``order`` > 0: its Taylor
    forecast), UniPC on the patch's own state, and writes no K/V."""
    c = models[0].config
    graphdef, _ = nnx.split(models[0])
    params = [nnx.state(m) for m in models]
    text = jnp.asarray(inputs.context["encoder_hidden_states"])
    assert text.shape[0] == 2 and inputs.cfg  # [uncond; cond] of one request
    g = pw.Geometry(inputs.grid, patches, 1, 1, 2, 1, text.shape[1], patch_by=patch_by)
    split = lambda a: jnp.asarray(g.to_patches(np.asarray(a, np.float32), 1))  # [1, M, n, k]
    x = split(inputs.tokens)
    extras = {name: split(a) for name, a in inputs.extras.items()}
    positions = jnp.asarray(g.to_patches(np.asarray(inputs.context["positions"]), 0))  # [M, n, 3]
    mask = inputs.context.get("timestep_mask")
    mask = None if mask is None else jnp.asarray(g.to_patches(np.asarray(mask), 0))  # [M, n]
    schedule = inputs.schedule
    steps = inputs.steps
    experts = inputs.experts or (0,) * steps
    scales = inputs.scales or (inputs.scale,) * steps

    def forward(state, xs, ex, pos, mask, t, scale, patch, buffers, kept=None):
        """(guided prediction, K/V buffers, residual of all blocks); ``kept``: no block runs, the
        embedding plus ``kept`` goes to the head (a skipped step)."""
        model = nnx.merge(graphdef, state)
        block_def, stacked = nnx.split(model.blocks)
        buffers = dict(buffers)
        if "condition" in ex:
            xs = jnp.concatenate([xs, ex["condition"]], -1)
        elif "first_frame" in ex:
            xs = jnp.where(ex["in_first_frame"] > 0, ex["first_frame"], xs)
        temb, mod, token_time = model.embed_token_time(jnp.full((2,), t, jnp.float32), mask)
        txt, _ = model.embed_context(text)
        angles = rope_angles(pos, c.rope_axes_dim, c.rope_theta)[None]
        h = start = model.patch_embedding(jnp.concatenate([xs, xs])).astype(jnp.float32)
        if kept is not None:
            h = start + kept
        for i in range(0 if kept is not None else c.num_layers):
            layer = nnx.merge(block_def, jax.tree.map(lambda a, i=i: a[i], stacked))
            ctx = ReferenceContext(buffers, i, patch)
            h = layer(h, mod, txt, None, angles, ctx, token_time=token_time)
        pred = swap_features(
            model.head_prediction(h, temb, token_time), math.prod(c.patch_size), c.out_channels
        )
        uncond, cond = jnp.split(pred, 2)
        return uncond + scale * (cond - uncond), buffers, h - start

    @jax.jit
    def full_step(state, x, sampler, step, scale):
        flat = lambda a: a.reshape(a.shape[0], -1, a.shape[-1])
        ex = {k: flat(a) for k, a in extras.items()}
        m = None if mask is None else mask.reshape(-1)
        t = jnp.asarray(schedule.timesteps)[step].astype(jnp.float32)
        v, buffers, residual = forward(state, flat(x), ex, positions.reshape(-1, 3), m, t, scale, None, {})
        per_patch = lambda a: jnp.moveaxis(a.reshape(a.shape[0], patches, -1, *a.shape[2:]), 1, 0)
        own = unipc.UniPCState(step, *(flat(a) for a in sampler[1:]))
        x_new, own = unipc.step(schedule, own, flat(x), v)
        sampler = unipc.UniPCState(step + 1, *(a.reshape(x.shape) for a in own[1:]))
        kv = {k: tuple(map(per_patch, kv)) for k, kv in buffers.items()}
        return x_new.reshape(x.shape), sampler, kv, per_patch(residual)

    @jax.jit
    def patch_step(state, x, sampler, m, step, scale, buffers, kept=None):
        pick = lambda a: lax.dynamic_index_in_dim(a, m, 1, keepdims=False)
        ex = {k: pick(a) for k, a in extras.items()}
        t = jnp.asarray(schedule.timesteps)[step].astype(jnp.float32)
        patch_mask = None if mask is None else mask[m]
        v, buffers, residual = forward(
            state, pick(x), ex, positions[m], patch_mask, t, scale, m, buffers, kept
        )
        own = unipc.UniPCState(step, *(pick(a) for a in sampler[1:]))
        xs, own = unipc.step(schedule, own, pick(x), v)
        put = lambda a, b: lax.dynamic_update_index_in_dim(a, b, m, 1)
        sampler = unipc.UniPCState(step + 1, *(put(a, b) for a, b in zip(sampler[1:], own[1:], strict=True)))
        return put(x, xs), sampler, buffers, residual

    sampler, buffers = unipc.init_state(x), None
    ran = (True,) * steps if ran is None else ran
    cache, last, full = TaylorResiduals(patches, order), 0, 0
    for step, synchronous in enumerate(warmup_steps_of(inputs.experts, steps, warmup)):
        state, scale = params[experts[step]], jnp.float32(scales[step])
        if synchronous:
            assert ran[step], f"step {step} is an expert's warm-up step: the plan must run it"
            x, sampler, buffers, residual = full_step(state, x, sampler, jnp.int32(step), scale)
            for m in range(patches):
                cache.refresh(m, residual[m], step - last, full)
        else:
            for m in range(patches):
                kept = None if ran[step] else cache.forecast(m, step - last)
                x, sampler, buffers_new, residual = patch_step(
                    state, x, sampler, jnp.int32(m), jnp.int32(step), scale, buffers, kept
                )
                if ran[step]:  # a skipped step writes no K/V
                    buffers = buffers_new
                    cache.refresh(m, residual, step - last, full)
        if ran[step]:
            last, full = step, full + 1
    return g.from_patches(np.asarray(x), 1)
