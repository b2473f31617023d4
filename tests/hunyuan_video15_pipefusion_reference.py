"""A serial statement of PipeFusion's pipelined phase (stale K/V) on an unsharded HunyuanVideo 1.5
transformer (``tests/test_hunyuan_video15_pipefusion.py``): full softmax over the patch's fresh K/V and the
other patches' buffered K/V, nothing of the runner's programs.

The steps run in order and, within a step, the patches in order: each layer of patch m reads this step's
K/V of the patches before it and the previous step's of those after it (the order the pipeline's schedule
gives every layer). The first ``warmup`` steps are the plain forward on every patch at once, each patch's
K/V stored. Patch m is the latent rows [m H'/M, (m+1) H'/M) of every frame plus chunk m of the prompt, the
glyph and the image tokens (each group padded to M equal chunks, pad tokens masked as keys); the token
refiner attends over prompt tokens alone, fresh and buffered; the dual-stream blocks over all groups. With
classifier-free guidance the model batch is [uncond; cond] of one request.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pipefusion_helpers import TaylorResiduals

from jaxdit.models import hunyuan_video15 as hv
from jaxdit.models.hunyuan_video15_config import TEXT
from jaxdit.models.layers import rope_angles
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.local_attention import reference_attention

GROUPS = (
    ("encoder_hidden_states", "encoder_attention_mask"),
    ("encoder_hidden_states_2", "encoder_attention_mask_2"),
    ("image_embeds", "image_embeds_mask"),
)


class _Context:
    """One block call's attention: ``valid`` [B, L] the fresh keys of the tokens in hand (groups in
    ``layout`` order); ``split`` per attention ("joint", or the refiner's group) each patch's indices in
    the warm-up's keys. Warm-up (``patch`` None): every patch at once, each patch's K/V stored; a
    pipelined patch: its fresh K/V plus the other patches' buffered ones."""

    def __init__(self, layout, buffers=None, patch=None, valid=None, patches=0, split=None):
        self.layout, self.buffers, self.patch, self.valid = layout, buffers, patch, valid
        self.patches, self.split = patches, split

    def sum_tensor_parallel(self, x):
        return x

    def _attend(self, key, q, k, v, valid, split):
        buffer = self.buffers.setdefault(key, {})
        if self.patch is None:
            buffer.update({m: (k[:, i], v[:, i], valid[:, i]) for m, i in enumerate(split)})
            return reference_attention(q, k, v, valid)
        others = [buffer[m] for m in range(self.patches) if m != self.patch]
        keys = jnp.concatenate([k, *(o[0] for o in others)], 1)
        values = jnp.concatenate([v, *(o[1] for o in others)], 1)
        mask = jnp.concatenate([valid, *(o[2] for o in others)], 1)
        buffer[self.patch] = (k, v, valid)
        return reference_attention(q, keys, values, mask)

    def attention(self, q, k, v):
        return self._attend("joint", q, k, v, self.valid, self.split["joint"])

    def group_attention(self, group):
        lo = sum(self.layout.local_lengths[:group])
        hi = lo + self.layout.local_lengths[group]
        return lambda q, k, v: self._attend(group, q, k, v, self.valid[:, lo:hi], self.split[group])


def serial_stale_kv(pipe, inputs, patches: int, warmup: int = 1, ran=None, order: int = 0) -> np.ndarray:
    """The final latent tokens of ``inputs`` (the pipeline's prepared ``DenoiseInputs``; one request) on
    ``pipe``'s unsharded model: ``warmup`` whole steps, then every later step patch by patch with the
    other patches' stale K/V.

    ``ran`` (a host-planned cache's plan, ``jaxdit.pipelines.pipefusion.cache``): each full step keeps,
    per patch, the residual of every block (refiner and dual-stream) on the video stream, the stream the
    output layer reads; a skipped step runs, per patch, the output layer on the embedded video tokens
    plus that residual (``order`` > 0: its Taylor forecast), no block and no K/V write."""
    model, sampler, schedule = pipe.model, pipe.sampler, inputs.schedule
    c = model.config
    ctx_in = {**inputs.context, **inputs.extras}
    f, h, w = inputs.grid
    band = h // patches
    grid = np.arange(f * h * w).reshape(f, h, w)
    video = [grid[:, m * band : (m + 1) * band].reshape(-1) for m in range(patches)]  # token indices
    x = np.array(inputs.tokens, np.float32)
    rows = x.shape[0]
    if rows != 1:
        raise ValueError("the reference runs one request")
    model_rows = len(ctx_in["encoder_hidden_states"])
    guided = model_rows == 2 * rows
    groups, masks, chunks = [], [], []
    for name, mask in GROUPS:
        if ctx_in.get(name) is None:
            continue
        feats = np.asarray(ctx_in[name], np.float32)
        valid = np.ones(feats.shape[:2], bool) if ctx_in.get(mask) is None else np.asarray(ctx_in[mask], bool)
        length, chunk = feats.shape[1], -(-feats.shape[1] // patches)
        pad = patches * chunk - length
        groups.append(np.pad(feats, [(0, 0), (0, pad), (0, 0)]))
        masks.append(np.pad(valid, [(0, 0), (0, pad)]))
        chunks.append(chunk)
    image = len(groups) == 3
    condition = ctx_in.get("condition")
    condition = None if condition is None else np.asarray(condition, np.float32)
    extra = c.input_features - c.output_features
    ids = np.asarray(ctx_in["video_ids"], np.float32)
    pooled = jnp.asarray(ctx_in["pooled_projections"], jnp.float32)
    buffers: dict = {}

    def run(patch, x_tokens, step, residual=None):
        """The (guided) prediction of ``patch``'s video tokens (None: every patch at once) and the
        blocks' residual on them; ``residual`` given: added to the embedded video, no block run."""
        whole = patch is None
        sel = [np.arange(patches * t) if whole else np.arange(patch * t, (patch + 1) * t) for t in chunks]
        vid = np.arange(f * h * w) if whole else video[patch]
        lengths = (len(vid), *(len(s) for s in sel))
        # Per patch, where its tokens lie in this call's joint [video; prompt; glyph(; image)] (warm-up).
        offsets = np.cumsum((0, *lengths))[:-1]
        split = {"joint": [], TEXT: []}
        for m in range(patches):
            own = [video[m]]  # the warm-up's video tokens are in patchify order
            own += [offsets[i + 1] + np.arange(m * t, (m + 1) * t) for i, t in enumerate(chunks)]
            split["joint"].append(np.concatenate(own))
            split[TEXT].append(np.arange(m * chunks[0], (m + 1) * chunks[0]))
        tokens = x_tokens
        extras = np.zeros((*tokens.shape[:-1], extra), np.float32) if condition is None else condition[:, vid]
        tokens = np.concatenate([tokens, extras], -1)
        if guided:
            tokens = np.concatenate([tokens, tokens], 0)
        feats = [jnp.asarray(gr[:, s]) for gr, s in zip(groups, sel, strict=True)]
        streams = model.embed_tokens(jnp.asarray(tokens), *feats, *(() if image else (None,)))
        t = jnp.full((model_rows,), sampler.model_time(schedule, step), jnp.float32)
        angles = rope_angles(jnp.asarray(ids[vid]), c.rope_axes_dim, c.rope_theta)[None]
        cond = hv.HunyuanVideo15Cond(*model.step_conditioning(t, pooled), angles)
        layout = SequenceLayout(lengths, 1)
        keys = [np.ones((model_rows, len(vid)), bool)] + [m[:, s] for m, s in zip(masks, sel, strict=True)]
        valid = jnp.asarray(np.concatenate(keys, 1))
        start = streams[0]
        if residual is not None:  # a skipped step
            streams = (start + residual, *streams[1:])
        for stack in model.STACKS if residual is None else ():
            streams = model.enter(stack, streams, _Context(layout))
            graphdef, state = nnx.split(getattr(model, stack))
            for layer in range(jax.tree.leaves(state)[0].shape[0]):
                block = nnx.merge(graphdef, jax.tree.map(lambda a, layer=layer: a[layer], state))
                store = buffers.setdefault((stack, layer), {})
                ctx = _Context(layout, store, patch, valid, patches, split)
                streams = model.run_block(stack, block, streams, cond, ctx)
        pred = model.output(streams, cond, _Context(layout))
        if guided:
            u, k = jnp.split(pred, 2, 0)
            pred = u + pipe_scale * (k - u)
        return pred, streams[0] - start

    pipe_scale = inputs.scale
    ran = (True,) * inputs.steps if ran is None else ran
    cache, last, full = TaylorResiduals(patches, order), 0, 0
    for step in range(inputs.steps):
        if step < warmup:
            v, residual = run(None, x, step)
            x = np.array(sampler.step(schedule, step, (), jnp.asarray(x), v)[0])
            for m in range(patches):
                cache.refresh(m, residual[:, video[m]], step - last, full)
        else:
            for m in range(patches):
                kept = None if ran[step] else cache.forecast(m, step - last)
                v, residual = run(m, x[:, video[m]], step, kept)
                x[:, video[m]] = np.asarray(
                    sampler.step(schedule, step, (), jnp.asarray(x[:, video[m]]), v)[0]
                )
                if ran[step]:
                    cache.refresh(m, residual, step - last, full)
        if ran[step]:
            last, full = step, full + 1
    return x
