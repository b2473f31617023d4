"""Feature caches on FLUX.2 [klein] (``jaxdit.cache``), on the tiny saved folder with two reference
pictures (578 reference tokens: the 4 sequence shards pad them), ring2 x ulysses2, 6 steps.

First-Block-Cache against a serial reference of its rule written on the unsharded model (nothing of
jaxdit's cache code): the first double block's residual on the image stream (reference tokens included,
what diffusers' hook compares on ``Flux2Transformer2DModel``: the block's ``hidden_states``), its mean
absolute change over the residual of the last step that ran, relative to that residual's mean absolute
value; below the threshold the other blocks are skipped and the final stream is the first block's output
(joined for the single blocks) plus the residual the rest of the blocks added on the last step that ran.
diffusers' own hook cannot run on FLUX.2 (diffusers 0.42.1: its tail hook subtracts the head's
(image, text) output from the single block's one joined tensor, a TypeError), so the reference is ours.

The random model's ratios lie between 0.8 and 1.9 a step; threshold 1.2 skips some steps and runs
others, every ratio more than 1% away from it. A tiny threshold runs every step: exactly the uncached
run. TeaCache has no published coefficients for FLUX.2: refused in one line naming how to give them, and
with given ones and a tiny threshold it is the uncached run too.
"""

from __future__ import annotations

import flux2_klein_tiny as tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.pipelines.flux2 import Flux2KleinPipeline
from jaxdit.pipelines.request import GenerationRequest

pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
THRESHOLD = 1.2
CALL = dict(
    prompt="a photo of a cat on a mat", height=32, width=48, num_inference_steps=6, seed=0,
    max_sequence_length=40, guidance_scale=1.0, output_type="latent", progress=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tiny.pipeline(tmp_path_factory.mktemp("flux2cache") / "klein")
    rng = np.random.default_rng(11)
    pictures = [Image.fromarray(rng.integers(0, 256, (68, 68, 3), dtype=np.uint8)) for _ in range(2)]
    pc = ParallelConfig(ring=2, ulysses=2)
    mesh = Flux2KleinPipeline.from_pretrained(folder, pc.make_mesh(jax.devices()[:4]), compiler_options=FAST)
    one = Flux2KleinPipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    return mesh, one, dict(CALL, image=pictures)


def _blocks(model, stack):
    graphdef, state = nnx.split(getattr(model, stack))
    depth = jax.tree.leaves(state)[0].shape[0]
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(depth)]


def _serial_first_block_cache(one: Flux2KleinPipeline, call: dict, threshold: float):
    """(latents, ran per step, ratio per step) of First-Block-Cache's rule on the unsharded model."""
    prepared = one.prepare(GenerationRequest.of(**call))
    inputs, model, sampler = prepared.inputs, one.model, one.sampler
    c = inputs.context
    lengths = (c["txt_ids"].shape[0], c["img_ids"].shape[0], c["reference_ids"].shape[0])
    ctx = ShardContext(ParallelConfig(), SequenceLayout(lengths, 1))
    double, single = _blocks(model, "double_blocks"), _blocks(model, "single_blocks")
    x = jnp.asarray(inputs.tokens)
    previous = stored = None
    ran, ratios = [], []
    for step in range(inputs.steps):
        sigma = jnp.full((x.shape[0],), sampler.model_time(inputs.schedule, step), jnp.float32)
        streams, cond = model.embed(
            {**{k: jnp.asarray(v) for k, v in c.items()}, "hidden_states": x, "timestep": sigma}, ctx
        )
        head = model.run_block("double_blocks", double[0], streams, cond, ctx)
        residual = head[1] - streams[1]  # the image stream, reference tokens included
        ratio = np.inf if previous is None else float(
            jnp.abs(residual - previous).mean() / jnp.abs(previous).mean()
        )  # fmt: skip
        run = not ratio < threshold
        base = model.enter("single_blocks", head, ctx)
        if run:
            s = head
            for block in double[1:]:
                s = model.run_block("double_blocks", block, s, cond, ctx)
            s = model.enter("single_blocks", s, ctx)
            for block in single:
                s = model.run_block("single_blocks", block, s, cond, ctx)
            final, stored, previous = s, s - base, residual
        else:
            final = base + stored
        ran.append(run)
        ratios.append(ratio)
        x = sampler.step(inputs.schedule, step, (), x, model.output(final, cond, ctx))[0]
    return prepared.to_latents(np.asarray(x)), ran, np.asarray(ratios)


def _relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_first_block_cache_matches_the_serial_rule(setup):
    mesh, one, call = setup
    want, ran, ratios = _serial_first_block_cache(one, call, THRESHOLD)
    got = mesh(cache=FirstBlockCache(THRESHOLD), **call)
    print(f"serial {np.asarray(ran, int)} ratios {np.round(ratios, 4)}")
    print(f"mesh   {got.cache.ran.astype(int)} ratios {np.round(got.cache.ratios, 4)}")
    print(f"latents {_relative(got.latents, want):.2e} relative")
    assert np.all(np.abs(ratios[1:] / THRESHOLD - 1) > 0.01)  # no decision rides on rounding
    assert 0 < sum(ran) < len(ran)  # some steps skipped, some run
    assert got.cache.ran.tolist() == ran and got.cache.devices_agree
    np.testing.assert_allclose(got.cache.ratios[1:], ratios[1:], rtol=1e-5)
    assert _relative(got.latents, want) <= 1e-5
    plain = mesh(**call).latents
    assert _relative(plain, want) > 1e-2  # skipping changed the result


def test_a_tiny_threshold_runs_every_block_and_is_the_plain_run(setup):
    mesh, _, call = setup
    plain = mesh(**call).latents
    for cache in (FirstBlockCache(threshold=1e-9), TeaCache(threshold=1e-9, coefficients=(1.0, 0.0))):
        out = mesh(cache=cache, **call)
        assert out.cache.ran.all() and out.cache.devices_agree and out.cache.skipped_blocks == 0
        np.testing.assert_array_equal(out.latents, plain)


def test_teacache_without_coefficients_is_refused(setup):
    mesh, _, call = setup
    with pytest.raises(ValueError, match=r"no published coefficients .* coefficients=\(\.\.\.\)"):
        mesh(cache=TeaCache(), **call)
