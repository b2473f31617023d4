"""Z-Image's pipelined PipeFusion phase (stale K/V) against a serial reference of the same semantics
written on the unsharded model (full softmax over the patch's fresh K/V and the other patches' buffered
K/V, nothing of the runner's programs), on the tiny saved folder: Turbo, two prompts of 16 and 42 tokens
(padded to 32 and 64: the shorter one's caption mask in play), pipefusion2 x ulysses2, 4 patches of 2
image rows and a 16-token caption chunk each, one warm-up step then three pipelined ones.

The reference runs the steps in order and, within a step, the patches in order: each layer of patch m
reads this step's K/V of the patches before it and the previous step's of those after it, which is the
order the pipeline's schedule gives every layer (a patch re-enters only after the last patch of the
previous step has passed the same layer). The refiners attend over their own token group only: the image
patch over every patch's image K/V, the caption chunk over every chunk's caption K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import z_image_tiny as tiny
from flax import nnx
from pipefusion_helpers import TaylorResiduals, six_step_cache

from jaxdit.mesh import ParallelConfig
from jaxdit.models import z_image
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.local_attention import reference_attention
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.z_image import ZImagePipeline

FAST = {"xla_backend_optimization_level": 0}
PROMPTS = [
    "a photo of a cat on a mat",
    "a big blue house with a tree at sunset and a small dog on a red mat next to a big red house with a "
    "small cat and a blue tree on a mat",
]
CALL = dict(height=32, width=48, num_inference_steps=4, guidance_scale=0.0, seed=3)
PATCHES = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    return folder


class _Context:
    """Attention of one block call of the reference: fresh keys ``valid`` [B, L] of the tokens in hand,
    plus (a pipelined patch) the other patches' buffered K/V of the same layer."""

    def __init__(self, layout, buffer, patch, valids, split):
        self.layout, self.buffer, self.patch, self.valids, self.split = layout, buffer, patch, valids, split

    def sum_tensor_parallel(self, x):
        return x

    def _attend(self, group, q, k, v):
        valid = self.valids[group]
        if self.patch is None:  # warm-up: every patch's tokens at once; store each patch's K/V
            self.buffer[group] = [
                (k[:, i], v[:, i], valid[:, i]) for i in self.split[group]
            ]  # split[group]: per patch the token indices
            return reference_attention(q, k, v, valid)
        others = [self.buffer[group][m] for m in range(PATCHES) if m != self.patch]
        keys = jnp.concatenate([k, *(o[0] for o in others)], 1)
        values = jnp.concatenate([v, *(o[1] for o in others)], 1)
        mask = jnp.concatenate([valid, *(o[2] for o in others)], 1)
        self.buffer[group][self.patch] = (k, v, valid)
        return reference_attention(q, keys, values, mask)

    def attention(self, q, k, v):
        return self._attend("joint", q, k, v)

    def group_attention(self, group):
        return lambda q, k, v: self._attend(group, q, k, v)


def _reference(pipe: ZImagePipeline, inputs, ran=None, order: int = 0) -> np.ndarray:
    """``ran`` (a host-planned cache's plan, ``jaxdit.pipelines.pipefusion.cache``): each full step keeps,
    per patch, the residual of every block on the image tokens (the joint stream's image part minus the
    embedded image, what the output layer reads); a skipped step runs, per patch, the output layer on
    the embedded image plus that residual (``order`` > 0: its Taylor forecast), no block, no K/V write."""
    model, sampler, schedule = pipe.model, pipe.sampler, inputs.schedule
    ctx_in = inputs.context
    rows, cols = inputs.grid
    n, t = rows * cols // PATCHES, -(-ctx_in["cap_feats"].shape[1] // PATCHES)
    pad = lambda a: np.pad(a, [(0, 0), (0, PATCHES * t - a.shape[1])] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    cap_feats, cap_pad, cap_ids = (pad(np.asarray(ctx_in[k])) for k in ("cap_feats", "cap_pad", "cap_ids"))
    length = ctx_in["cap_feats"].shape[1]
    cap_valid = pad(np.asarray(ctx_in.get("cap_mask", np.ones(ctx_in["cap_pad"].shape, bool))))
    cap_valid &= (np.arange(PATCHES * t) < length)[None]
    img_ids = np.asarray(ctx_in["img_ids"])
    x = np.asarray(inputs.tokens, np.float32)
    batch = x.shape[0]

    def run(patch, x_tokens, step, residual=None):
        """The velocity of ``patch``'s image tokens (None: every patch, the warm-up's full sequence) and
        the blocks' residual on them; ``residual`` given: added to the embedded image, no block run."""
        img_sel = np.arange(rows * cols) if patch is None else np.arange(patch * n, (patch + 1) * n)
        cap_sel = np.arange(PATCHES * t) if patch is None else np.arange(patch * t, (patch + 1) * t)
        img, cap = model.embed_tokens(jnp.asarray(x_tokens), None, cap_feats[:, cap_sel], cap_pad[:, cap_sel])
        sigma = jnp.full((batch,), sampler.model_time(schedule, step), jnp.float32)
        temb = model.t_embedder(
            z_image.time_features((1000.0 - sigma * 1000.0) / 1000.0, model.config.t_scale)
        )
        a_img, a_cap = (
            model.angles(jnp.asarray(img_ids[:, img_sel])),
            model.angles(jnp.asarray(cap_ids[:, cap_sel])),
        )
        layout = SequenceLayout((len(img_sel), len(cap_sel)), 1)
        cond = z_image.ZImageCond(
            temb, jnp.ones(len(img_sel), bool), (a_img, a_cap, jnp.concatenate([a_img, a_cap], 1))
        )
        cv = jnp.asarray(cap_valid[:, cap_sel])
        iv = jnp.ones((batch, len(img_sel)), bool)
        valids = {0: iv, 1: cv, "joint": jnp.concatenate([iv, cv], 1)}
        split = {
            0: [np.arange(m * n, (m + 1) * n) for m in range(PATCHES)],
            1: [np.arange(m * t, (m + 1) * t) for m in range(PATCHES)],
            "joint": [
                np.concatenate([np.arange(m * n, (m + 1) * n), rows * cols + np.arange(m * t, (m + 1) * t)])
                for m in range(PATCHES)
            ],
        }
        streams = (img, cap)
        if residual is not None:  # a skipped step: [image + residual; caption], as the joint layers see it
            streams = layout.join_local([img + residual, cap])
        for stack in model.STACKS if residual is None else ():
            streams = model.enter(stack, streams, _Context(layout, None, None, None, None))
            graphdef, state = nnx.split(getattr(model, stack))
            depth = jax.tree.leaves(state)[0].shape[0]
            for layer in range(depth):
                block = nnx.merge(graphdef, jax.tree.map(lambda a, layer=layer: a[layer], state))
                key = (stack, layer)
                store = buffers.setdefault(key, {})
                ctx = _Context(layout, store, patch, valids, split)
                streams = model.run_block(stack, block, streams, cond, ctx)
        out = -model.output(streams, cond, _Context(layout, None, None, None, None))
        return out, layout.split_local(streams)[0] - img

    buffers: dict = {}
    ran = (True,) * inputs.steps if ran is None else ran
    cache = TaylorResiduals(PATCHES, order)
    v, residual = run(None, x, 0)
    x = np.array(sampler.step(schedule, 0, (), jnp.asarray(x), v)[0])
    for m in range(PATCHES):
        cache.refresh(m, residual[:, m * n : (m + 1) * n], 0, 0)
    last, full = 0, 1  # the warm-up step
    for step in range(1, inputs.steps):
        for m in range(PATCHES):
            band = slice(m * n, (m + 1) * n)
            v, residual = run(m, x[:, band], step, None if ran[step] else cache.forecast(m, step - last))
            x[:, band] = np.asarray(sampler.step(schedule, step, (), jnp.asarray(x[:, band]), v)[0])
            if ran[step]:
                cache.refresh(m, residual, step - last, full)
        if ran[step]:
            last, full = step, full + 1
    return x


@pytest.fixture(scope="module")
def pipe(folder):
    pc = ParallelConfig(pipefusion=2, ulysses=2)
    return ZImagePipeline.from_pretrained(folder, pc.make_mesh(jax.devices()[:4]), compiler_options=FAST)


def test_pipelined_pipefusion_matches_the_serial_reference(folder, pipe):
    one = ZImagePipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    got = pipe(
        PROMPTS, num_pipeline_patch=PATCHES, warmup_steps=1, output_type="latent", progress=False, **CALL
    )
    prepared = one.prepare(GenerationRequest(prompt=list(PROMPTS), **CALL))
    assert prepared.inputs.context.get("cap_mask") is not None  # the prompts pad to 32 and 64
    want = prepared.to_latents(_reference(one, prepared.inputs))
    serial = one(PROMPTS, output_type="latent", progress=False, **CALL).latents
    err = float(np.abs(got.latents - want).max() / np.abs(want).max())
    print(
        f"pipelined vs serial reference {err:.2e}; vs the plain run {np.abs(got.latents - serial).max() / np.abs(serial).max():.2e}"
    )
    tol.check(got.latents, want, tol.PIPEFUSION, "Z-Image pipelined PipeFusion vs the serial reference")
    assert np.abs(serial - want).max() > 1e-3 * np.abs(serial).max()  # stale K/V changed the result


#: Host-planned caches under PipeFusion (jaxdit/pipelines/pipefusion/cache.py) over 6 steps: MagCache on
#: made-up ratios (threshold 0.5, at most 2 skips in a row: steps 1, 2, 4, 5 skipped, the first two by the
#: warm-up step's program), TaylorSeer (interval 2, one warm-up step: 1, 3, 5 skipped).
CACHE_CASES = {"magcache": [1, 0, 0, 1, 0, 0], "taylorseer": [1, 0, 1, 0, 1, 0]}


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_host_planned_cache_matches_the_serial_reference(folder, pipe, tmp_path, name):
    """Three passes (noise refiner, context refiner, joint layers) skipped on a skipped step, the patch
    back to stage 0 after the odd last pass: pipefusion2 x ulysses2 against the serial reference with
    the same plan and stale K/V; the cache moves the result against uncached PipeFusion."""
    cache, order = six_step_cache(name, tmp_path)
    call = {**CALL, "num_inference_steps": 6}
    got = pipe(
        PROMPTS,
        num_pipeline_patch=PATCHES,
        warmup_steps=1,
        output_type="latent",
        progress=False,
        cache=cache,
        **call,
    )
    print(f"\n{name}: {got.cache.describe()}")
    plan = CACHE_CASES[name]
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    one = ZImagePipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    prepared = one.prepare(GenerationRequest(prompt=list(PROMPTS), **call))
    want = prepared.to_latents(_reference(one, prepared.inputs, tuple(bool(r) for r in plan), order))
    uncached = prepared.to_latents(_reference(one, prepared.inputs))
    tol.check(
        got.latents, want, tol.PIPEFUSION, f"Z-Image {name} pipefusion2 x ulysses2 vs the serial reference"
    )
    drift = tol.max_error(got.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(cfg_normalization=True), "cfg_normalization caps each image's guided norm"),
        (dict(cfg_truncation=0.1), "PipeFusion takes one guidance scale per run"),
    ],
)
def test_per_image_or_per_step_guidance_is_refused(pipe, option, message):
    call = dict(CALL, guidance_scale=2.0, num_inference_steps=2)
    with pytest.raises(ValueError, match=message):
        pipe(PROMPTS[0], output_type="latent", progress=False, **call, **option)
