"""Qwen-Image-Edit on the strategies its CLI test (``test_qwen_image_edit.py``: cfg2 x ulysses2, ulysses2 x
ring2, on Edit-2509 and Edit) leaves out, on the tiny Edit-2511 folder of ``qwen_image_edit_folder.py`` (a
Plus folder whose transformer sets ``zero_cond_t``: the reference tokens take the modulation of timestep
0, the most the reference tokens ask of a layout): an instruction, two pictures (448 reference tokens
joined to the 80 denoised ones), true CFG 4.0, two images per prompt (so that data parallelism has a batch
to split), fp32, against the same call on one device:

- data2 x ulysses2 x tensor2 (the batch, the sequence and the heads / MLPs each over two devices);
- PipeFusion (pipefusion2 x ulysses2) with every step a warm-up step: the serial computation on another
  mesh, so the one-device run is its reference;
- PipeFusion's pipelined phase (one warm-up step, then stale K/V), against a serial reference of the same
  semantics on the unsharded model (as ``test_z_image_pipefusion.py``): each patch holds [text chunk m;
  image rows m; reference chunk m], the reference chunks never denoised; the steps run in order and, in a
  step, the patches in order, each layer of patch m attending to its fresh K/V and every other patch's
  latest (this step's for those before it, the previous step's for those after it), the padded text and
  reference tokens and the prompts' masked ones no key.

Also every feature cache Qwen-Image has (First-Block-Cache, TeaCache, DBCache, TaylorSeer, MagCache) on
8 devices against one, and a LoRA fused into the edit transformer against diffusers' ``load_lora_weights``.
Bounds: SAME_SEED, PIPEFUSION (``tolerance.py``); against diffusers the project's 1e-4 relative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from flax import nnx
from PIL import Image
from pipefusion_helpers import TaylorResiduals, six_step_cache

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import qwen_image_edit_folder as edit_folder  # noqa: E402

from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.models import qwen_image  # noqa: E402
from jaxdit.parallel.layout import SequenceLayout  # noqa: E402
from jaxdit.parallel.local_attention import reference_attention  # noqa: E402
from jaxdit.pipelines.qwen_image import norm_preserving_guidance  # noqa: E402
from jaxdit.pipelines.qwen_image_edit import QwenImageEditPipeline  # noqa: E402
from jaxdit.pipelines.request import GenerationRequest  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
H, W, STEPS, SEED, CFG, PATCHES = 32, 40, 3, 5, 4.0, 2
LATENT_REL = 1e-4  # against diffusers: the project's latents bound (test_qwen_image_edit.py's)
CALL = dict(
    prompt="a red car at sunset",
    negative_prompt="a big dog",
    true_cfg_scale=CFG,
    height=H,
    width=W,
    num_inference_steps=STEPS,
    num_images_per_prompt=2,
    seed=SEED,
)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, the two pictures, the one-device pipeline, its final latents, diffusers' reloader)."""
    patch = pytest.MonkeyPatch()
    edit_folder.patch_areas(patch)
    saved = edit_folder.save(tmp_path_factory.mktemp("qwen_image_edit_strategies"), zero_cond_t=True)
    folder = saved["folders"]["plus"]
    pictures = [Image.open(p).convert("RGB") for p in saved["paths"]]
    one = QwenImageEditPipeline.from_pretrained(folder, _mesh(ParallelConfig()), compiler_options=FAST)
    want = one(pictures, **CALL, output_type="latent", progress=False).latents
    yield folder, pictures, one, want, saved["reloaded"]
    patch.undo()


def _mesh(config: ParallelConfig):
    return config.make_mesh(jax.devices()[: config.num_devices])


def _run(case, config_or_pipe, **options) -> np.ndarray:
    folder, pictures = case[:2]
    pipe = config_or_pipe
    if isinstance(pipe, ParallelConfig):
        pipe = QwenImageEditPipeline.from_pretrained(folder, _mesh(pipe), compiler_options=FAST)
    return pipe(pictures, **CALL, **options, output_type="latent", progress=False).latents


@pytest.fixture(scope="module")
def pipefusion(case):
    """pipefusion2 x ulysses2, shared by the warm-up-only and the pipelined runs."""
    mesh = _mesh(ParallelConfig(pipefusion=2, ulysses=2))
    return QwenImageEditPipeline.from_pretrained(case[0], mesh, compiler_options=FAST)


@pytest.fixture(scope="module")
def sharded(case):
    """data2 x ulysses2 x tensor2 (8 devices), shared by the plain run and the feature caches."""
    mesh = _mesh(ParallelConfig(data=2, ulysses=2, tensor=2))
    return QwenImageEditPipeline.from_pretrained(case[0], mesh, compiler_options=FAST)


def test_data2_ulysses2_tensor2_matches_one_device(case, sharded):
    got = _run(case, sharded)
    tol.check(got, case[3], tol.SAME_SEED, "Qwen-Image-Edit data2 x ulysses2 x tensor2 vs one device")


def _caches(tmp_path):
    """Every feature cache Qwen-Image has, each set to skip: thresholds far above the random model's
    changes (decisions nowhere near a boundary); MagCache reads a ratios file of constant ratios (its
    plan is made on the host from the file alone: skip while the accumulated error stays below 1)."""
    from jaxdit.cache import DBCache, FirstBlockCache, MagCache, TaylorSeer, TeaCache
    from jaxdit.cache.calibrate import save_calibration_file

    ratios = tmp_path / "ratios.json"
    save_calibration_file(str(ratios), np.ones((1, STEPS)), source="constant ratios (a test)")
    return {
        "fbcache": FirstBlockCache(threshold=10.0),
        "teacache": TeaCache(threshold=10.0, coefficients=(1.0, 0.0)),  # none are published
        "dbcache": DBCache(threshold=10.0, fn=1, bn=0, warmup=1),
        "taylorseer": TaylorSeer(interval=2, warmup=1),
        "magcache": MagCache(ratios=str(ratios), threshold=1.0, retention=0.0),
    }


def test_feature_caches_with_reference_tokens_match_one_device(case, sharded, tmp_path):
    """Each cache on the sharded mesh makes the one-device run's decisions (the reference tokens are in
    the image stream the metrics read, their padding masked) and its latents; each skips a step."""
    folder, pictures, one, plain = case[:4]
    for name, cache in _caches(tmp_path).items():
        want = one(pictures, **CALL, cache=cache, output_type="latent", progress=False)
        got = sharded(pictures, **CALL, cache=cache, output_type="latent", progress=False)
        assert not want.cache.ran.all() and got.cache.devices_agree, (name, want.cache.ran)
        np.testing.assert_array_equal(got.cache.ran, want.cache.ran)
        tol.check(got.latents, want.latents, tol.SAME_SEED, f"Qwen-Image-Edit {name}, 8 devices vs one")
        assert np.abs(want.latents - plain).max() > 1e-3 * np.abs(plain).max(), name  # it skipped work


def test_pipefusion_warmup_only_matches_one_device(case, pipefusion):
    """Every step a warm-up step: the reference chunks of every patch in one full-sequence forward."""
    got = _run(case, pipefusion, warmup_steps=STEPS, num_pipeline_patch=PATCHES)
    tol.check(got, case[3], tol.SAME_SEED, "Qwen-Image-Edit PipeFusion warm-up only vs one device")


# ------------------------------------------------------------------ pipelined PipeFusion, serially


class _Context:
    """Attention of one block call of the serial reference: the tokens in hand (keys ``valid`` [B, L]),
    plus for a pipelined patch the other patches' latest K/V of the same layer (``store``)."""

    def __init__(self, layout, store, patch, valid, split):
        self.layout, self.store, self.patch, self.valid, self.split = layout, store, patch, valid, split

    def sum_tensor_parallel(self, x):
        return x

    def backend_options(self):
        return {}

    def attention(self, q, k, v):
        if self.patch is None:  # warm-up: every patch at once; keep each patch's K/V
            self.store[:] = [(k[:, i], v[:, i], self.valid[:, i]) for i in self.split]
            return reference_attention(q, k, v, self.valid)
        others = [self.store[m] for m in range(PATCHES) if m != self.patch]
        keys = jnp.concatenate([k, *(o[0] for o in others)], 1)
        values = jnp.concatenate([v, *(o[1] for o in others)], 1)
        mask = jnp.concatenate([self.valid, *(o[2] for o in others)], 1)
        self.store[self.patch] = (k, v, self.valid)
        return reference_attention(q, keys, values, mask)


def _chunks(x: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    """[.., L, ..] -> zero-padded to PATCHES equal chunks along ``axis``; (padded, chunk length)."""
    size = -(-x.shape[axis] // PATCHES)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, PATCHES * size - x.shape[axis])
    return np.pad(x, widths), size


def _serial_pipefusion(pipe: QwenImageEditPipeline, inputs, ran=None, order: int = 0) -> np.ndarray:
    """The pipelined PipeFusion run, serially (also used by ``test_qwen_image_edit_reference_tokens.py``
    on the folders without ``zero_cond_t``, and by ``test_qwen_image_features.py`` on Qwen-Image's text
    to image, with no reference tokens; true CFG ``CFG``, ``PATCHES`` patches).

    ``ran`` (a host-planned cache's plan, ``jaxdit.pipelines.pipefusion.cache``; None: every step full):
    each full step keeps, per patch, the residual of every block on the image tokens (the image stream's
    image band minus the embedded band, what the output layer reads; the reference tokens and the text
    are read by no output); a skipped step runs, per patch, the output layer on the embedded image band
    plus that residual (``order`` > 0: its Taylor forecast), no block, no K/V write."""
    model, sampler, schedule, c = pipe.model, pipe.sampler, inputs.schedule, inputs.context
    rows, cols = inputs.grid
    n = rows * cols // PATCHES  # image tokens per patch: a band of rows
    text, t = _chunks(np.asarray(c["encoder_hidden_states"], np.float32), 1)
    text_valid, _ = _chunks(np.asarray(c["encoder_hidden_states_mask"], bool), 1)
    txt_ids, _ = _chunks(np.asarray(c["txt_ids"]), 0)
    # Qwen-Image (no input pictures; ``test_qwen_image_features.py``): an empty reference group.
    if "reference_hidden_states" not in c:
        c = {**c, "reference_hidden_states": np.zeros((len(text), 0, model.config.in_channels), np.float32)}
        c["reference_ids"] = np.zeros((0, 3), np.float32)
    length = c["reference_hidden_states"].shape[1]
    ref, r = _chunks(np.asarray(c["reference_hidden_states"], np.float32), 1)
    ref_ids, _ = _chunks(np.asarray(c["reference_ids"]), 0)
    ref_valid = np.broadcast_to(np.arange(PATCHES * r) < length, (text.shape[0], PATCHES * r))
    img_ids = np.asarray(c["img_ids"])
    x = np.asarray(inputs.tokens, np.float32)
    batch, stores = text.shape[0], {}
    rope = lambda ids: model.rope(jnp.asarray(ids))[None]  # noqa: E731
    # Edit-2511 (zero_cond_t): the reference tokens' modulation of timestep 0; otherwise the step's
    clean = model.time_embedding(jnp.zeros((batch,), jnp.float32)) if model.config.zero_cond_t and r else None

    def run(patch, tokens, step, residual=None):
        """The guided velocity of ``patch``'s image tokens (None: every patch, the warm-up) and the blocks'
        residual on them; ``residual`` given: added to the embedded image tokens, no block run."""
        pick = lambda size, m: np.arange(PATCHES * size) if m is None else np.arange(m * size, (m + 1) * size)  # noqa: E731
        ti, ri = pick(t, patch), pick(r, patch)
        ii = np.arange(rows * cols) if patch is None else np.arange(patch * n, (patch + 1) * n)
        latents = jnp.concatenate([jnp.asarray(np.concatenate([tokens, tokens])), jnp.asarray(ref[:, ri])], 1)
        streams = model.embed_tokens(jnp.asarray(text[:, ti]), latents)
        angles = (rope(txt_ids[ti]), rope(np.concatenate([img_ids[ii], ref_ids[ri]])))
        temb = model.time_embedding(jnp.full((batch,), sampler.model_time(schedule, step), jnp.float32))
        cond = qwen_image.QwenImageCond(temb, angles, clean)
        layout = SequenceLayout((len(ti), len(ii)) + ((len(ri),) if r else ()), 1)
        valid = jnp.asarray(
            np.concatenate([text_valid[:, ti], np.ones((batch, len(ii)), bool), ref_valid[:, ri]], 1)
        )
        split = [  # each patch's positions in the joined [text; image; reference] sequence (warm-up)
            np.concatenate(
                [
                    m * t + np.arange(t),
                    len(ti) + m * n + np.arange(n),
                    len(ti) + len(ii) + m * r + np.arange(r),
                ]
            )
            for m in range(PATCHES)
        ]
        embedded = streams[1][:, : len(ii)]  # the image band (the reference tokens follow it)
        if residual is not None:  # a skipped step: the output layer on the embedded band + the residual
            streams = (streams[0], streams[1].at[:, : len(ii)].add(residual))
        graphdef, state = nnx.split(model.transformer_blocks)
        for layer in range(model.config.num_layers if residual is None else 0):
            block = nnx.merge(graphdef, jax.tree.map(lambda a, layer=layer: a[layer], state))
            ctx = _Context(layout, stores.setdefault(layer, [None] * PATCHES), patch, valid, split)
            streams = model.run_block("transformer_blocks", block, streams, cond, ctx)
        pred = model.output(streams, cond, _Context(layout, None, None, None, None))
        half = pred.shape[0] // 2  # one device: [negative rows; positive rows]
        guided = norm_preserving_guidance(pred[:half], pred[half:], jnp.float32(CFG))
        return guided, streams[1][:, : len(ii)] - embedded

    ran = (True,) * inputs.steps if ran is None else tuple(bool(r) for r in ran)
    assert ran[0], "the warm-up step runs every block"
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


def test_pipelined_pipefusion_matches_the_serial_reference(case, pipefusion):
    folder, pictures, one, plain = case[:4]
    got = _run(case, pipefusion, warmup_steps=1, num_pipeline_patch=PATCHES)
    prepared = one.prepare(GenerationRequest.of(image=pictures, **CALL))
    assert prepared.inputs.context["reference_hidden_states"].shape[1] == 256 + 192  # both pictures
    want = prepared.to_latents(_serial_pipefusion(one, prepared.inputs))
    tol.check(got, want, tol.PIPEFUSION, "Qwen-Image-Edit pipelined PipeFusion vs the serial reference")
    assert np.abs(plain - want).max() > 1e-3 * np.abs(plain).max()  # stale K/V changed the result


#: Host-planned caches under PipeFusion (jaxdit/pipelines/pipefusion/cache.py) over 6 steps: MagCache on
#: made-up ratios (threshold 0.5, at most 2 skips in a row: steps 1, 2, 4, 5 skipped, the first two by the
#: warm-up step's program), TaylorSeer (interval 2, one warm-up step: 1, 3, 5 skipped).
CACHE_STEPS = 6
CACHE_CASES = {"magcache": [1, 0, 0, 1, 0, 0], "taylorseer": [1, 0, 1, 0, 1, 0]}


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_host_planned_cache_with_reference_tokens_matches_the_serial_reference(
    case, pipefusion, tmp_path, name
):
    """pipefusion2 x ulysses2 with true CFG on Edit-2511 (reference tokens joined to the image stream,
    their modulation of timestep 0): the host's plan, and the latents of the serial reference with the
    same plan and stale K/V (a skipped step adds the image band's residual of all blocks, or its Taylor
    forecast, and writes no K/V); the cache moves the result against uncached PipeFusion."""
    folder, pictures, one = case[:3]
    cache, order = six_step_cache(name, tmp_path)
    call = {**CALL, "num_inference_steps": CACHE_STEPS}
    got = pipefusion(
        pictures,
        **call,
        num_pipeline_patch=PATCHES,
        warmup_steps=1,
        output_type="latent",
        progress=False,
        cache=cache,
    )
    print(f"\n{name}: {got.cache.describe()}")
    plan = CACHE_CASES[name]
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    prepared = one.prepare(GenerationRequest.of(image=pictures, **call))
    want = prepared.to_latents(_serial_pipefusion(one, prepared.inputs, plan, order))
    uncached = prepared.to_latents(_serial_pipefusion(one, prepared.inputs))
    tol.check(
        got.latents,
        want,
        tol.PIPEFUSION,
        f"Qwen-Image-Edit {name} pipefusion2 x ulysses2 vs the serial reference",
    )
    drift = tol.max_error(got.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e} (max |latent| {np.abs(want).max():.2f})")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())


# ------------------------------------------------------------------ LoRA


def test_kohya_lora_on_the_edit_transformer_matches_diffusers(case, sharded, tmp_path):
    """Qwen-Image's LoRA converters (the family's, so every layout ``test_qwen_image_features.py`` checks)
    fused into the edit transformer on 8 devices: a kohya file (``lora_unet_`` + underscored module names,
    alpha) against diffusers' ``QwenImageEditPlusPipeline.load_lora_weights`` on the reloaded folder, the
    same call and noise."""
    import diffusers
    import lora_tiny
    import torch

    from jaxdit.pipelines import latents as latent_ops

    folder, pictures, _, plain, reloaded = case
    ref = reloaded(diffusers.QwenImageEditPlusPipeline, folder)
    shapes = {k: tuple(v.shape) for k, v in ref.transformer.state_dict().items()}
    del ref
    modules = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.net.0.proj", "img_in"]
    kohya = lora_tiny.write_kohya_style(
        tmp_path / "kohya.safetensors", shapes, modules, prefix="lora_unet_", underscore=True
    )
    noise = latent_ops.initial_noise(SEED, (2, 4, H // 2, W // 2))

    def reference(lora):
        pipe = reloaded(diffusers.QwenImageEditPlusPipeline, folder)
        pipe.load_lora_weights(str(lora))
        call = {k: v for k, v in CALL.items() if k != "seed"}
        with torch.no_grad():
            packed = pipe(
                pictures, **call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="latent"
            ).images
        return latent_ops.unpack(packed.numpy(), H // 2, W // 2)

    want = reference(kohya)
    sharded.load_lora(str(kohya))
    try:
        got = _run(case, sharded)
    finally:
        sharded.unload_lora()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    without = np.linalg.norm(plain - want) / np.linalg.norm(want)
    print(f"kohya LoRA on Qwen-Image-Edit-2511 vs diffusers: {rel:.2e} relative (without it: {without:.2e})")
    assert rel < LATENT_REL < without, (rel, without)
