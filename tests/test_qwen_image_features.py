"""Qwen-Image beyond the done test, on the tiny folder of ``qwen_image_folder.py``: the text mask in
pipelined PipeFusion (stale K/V), LoRA layouts against diffusers' ``load_lora_weights``, ``jaxdit
serve``'s engine against diffusers' picture, and the feature caches. fp32; bounds as the pipeline test's.
"""

from __future__ import annotations

import numpy as np
import pytest
import qwen_image_folder
from PIL import Image
from qwen_image_folder import CFG, NEGATIVE, PROMPT, SEED, STEPS, H, W

from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

LATENT_REL, PNG_STEPS = 1e-4, 1.5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, diffusers' final latents [1, 4, h, w], diffusers' pixels [H, W, 3] in [0, 1])."""
    folder = qwen_image_folder.save(tmp_path_factory.mktemp("qwen_image"))
    return (str(folder), *qwen_image_folder.reference(folder))


@pytest.fixture(scope="module")
def pipefusion(case):
    """pipefusion2 x ulysses2, shared by the text-mask and the feature-cache runs."""
    from jaxdit import ParallelConfig
    from jaxdit.pipelines.qwen_image import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(
        case[0],
        ParallelConfig(pipefusion=2, ulysses=2),
        compiler_options={"xla_backend_optimization_level": 0},
    )


def test_masked_text_is_no_key_in_pipelined_pipefusion(pipefusion):
    """Past its warm-up PipeFusion attends to stale K/V of other patches, which diffusers has no
    counterpart of; what must still hold exactly is the mask: text tokens a prompt's mask leaves out are
    no key anywhere, fresh or stale, so filling them with large values changes nothing."""
    pipe = pipefusion
    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((2, 7, pipe.config.joint_attention_dim)).astype(np.float32)
    mask = np.arange(7)[None] < np.array([[7], [3]])  # prompt rows of 7 and 3 real tokens
    run = lambda x: (
        pipe(
            prompt_embeds=x[:1],
            prompt_embeds_mask=mask[:1],
            negative_prompt_embeds=x[1:],
            negative_prompt_embeds_mask=mask[1:],
            height=H,
            width=W,
            num_inference_steps=3,
            warmup_steps=1,
            num_pipeline_patch=2,
            output_type="latent",
            progress=False,
        ).latents
    )
    clean = run(np.where(mask[..., None], embeds, 0))
    noisy = run(np.where(mask[..., None], embeds, 100 * embeds))
    np.testing.assert_allclose(noisy, clean, rtol=0, atol=1e-5)
    assert np.isfinite(clean).all()


def test_taylorseer_under_pipefusion_matches_the_serial_reference(case, pipefusion):
    """Text to image (no reference group: [text; image] per patch, the prompts' masks differing) with a
    host-planned cache under PipeFusion: TaylorSeer (interval 2, order 1: steps 1, 3, 5 of 6 skipped) on
    pipefusion2 x ulysses2 with true CFG, against ``test_qwen_image_edit_strategies.py``'s serial
    reference with the same plan and stale K/V; the cache moves the result against uncached PipeFusion.
    (MagCache and the edit pipelines' reference tokens: that file.)"""
    import jax
    import test_qwen_image_edit_strategies as strategies
    import tolerance as tol

    from jaxdit import ParallelConfig
    from jaxdit.cache import TaylorSeer
    from jaxdit.pipelines.qwen_image import QwenImagePipeline
    from jaxdit.pipelines.request import GenerationRequest

    assert (CFG, H, W) == (strategies.CFG, strategies.H, strategies.W)  # the reference's call
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=CFG, height=H, width=W, seed=SEED)
    call["num_inference_steps"] = 6
    got = pipefusion(
        **call,
        num_pipeline_patch=strategies.PATCHES,
        warmup_steps=1,
        output_type="latent",
        progress=False,
        cache=TaylorSeer(interval=2, order=1, warmup=1),
    )
    print(f"\n{got.cache.describe()}")
    plan = [1, 0, 1, 0, 1, 0]
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    one = QwenImagePipeline.from_pretrained(
        case[0],
        ParallelConfig().make_mesh(jax.devices()[:1]),
        compiler_options={"xla_backend_optimization_level": 0},
    )
    prepared = one.prepare(GenerationRequest(**call))
    assert "reference_hidden_states" not in prepared.inputs.context
    mask = np.asarray(prepared.inputs.context["encoder_hidden_states_mask"])
    assert not mask.all()  # the negative prompt is the shorter: its padding is no key
    want = prepared.to_latents(strategies._serial_pipefusion(one, prepared.inputs, plan, order=1))
    uncached = prepared.to_latents(strategies._serial_pipefusion(one, prepared.inputs))
    tol.check(
        got.latents,
        want,
        tol.PIPEFUSION,
        "Qwen-Image TaylorSeer pipefusion2 x ulysses2 vs the serial reference",
    )
    drift = tol.max_error(got.latents, uncached)
    print(f"vs uncached PipeFusion: {drift:.1e} (max |latent| {np.abs(want).max():.2f})")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())


# ------------------------------------------------------------------ LoRA layouts


def test_loras_of_every_layout_match_diffusers(case, tmp_path):
    """A kohya LoRA (``lora_unet_`` + underscored module names, alpha), the same factors in ComfyUI's
    layout (``diffusion_model.`` + module names), a PEFT LoRA written by diffusers, and a LoRA in the
    layout of lightx2v's Qwen-Image-Lightning 4/8-step files (diffusers' module names unprefixed,
    ``lora_down``/``lora_up`` with an ``.alpha`` below the rank: theirs is 8 at rank 64; later releases
    name the factors ``lora_A``/``lora_B``, the same delta), each fused on a 2-device mesh, against
    diffusers' ``load_lora_weights`` on the reloaded folder (2 steps with CFG)."""
    import lora_tiny
    from safetensors.numpy import load_file

    from converters.safetensors_io import write_safetensors
    from jaxdit import ParallelConfig
    from jaxdit.pipelines.qwen_image import QwenImagePipeline

    folder = case[0]
    ref = diffusers.QwenImagePipeline.from_pretrained(folder)
    shapes = {k: tuple(v.shape) for k, v in ref.transformer.state_dict().items()}
    modules = [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.add_k_proj",
        "transformer_blocks.1.attn.to_out.0",
        "transformer_blocks.1.img_mlp.net.0.proj",
        "transformer_blocks.0.txt_mlp.net.2",
        "transformer_blocks.1.txt_mod.1",
        "img_in",
    ]
    kohya = lora_tiny.write_kohya_style(
        tmp_path / "kohya.safetensors", shapes, modules, prefix="lora_unet_", underscore=True
    )
    tensors = load_file(kohya)
    comfy = {
        k.replace("lora_unet_", "diffusion_model.").replace(m.replace(".", "_"), m): v
        for k, v in tensors.items()
        for m in modules
        if k.startswith("lora_unet_" + m.replace(".", "_") + ".")
    }
    write_safetensors(tmp_path / "comfy.safetensors", comfy)
    # Lightning adapts every linear layer of the blocks; alpha / rank = 1/8 as in its files.
    lightning = lora_tiny.write_kohya_style(
        tmp_path / "lightning.safetensors",
        shapes,
        modules[:-1],
        prefix="",
        underscore=False,
        rank=8,
        alpha=1.0,
    )
    renamed = {
        k.replace(".lora_down.", ".lora_A.").replace(".lora_up.", ".lora_B."): v
        for k, v in load_file(lightning).items()
    }
    write_safetensors(tmp_path / "lightning_ab.safetensors", renamed)
    peft = lora_tiny.write_peft(
        ref.transformer, tmp_path / "peft.safetensors", ["to_v", "add_q_proj", "img_mlp.net.2"], pipeline=ref
    )
    noise = torch.from_numpy(latent_ops.pack(latent_ops.initial_noise(SEED, (1, 4, H // 2, W // 2))))
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=CFG, height=H, width=W)

    def reference(lora):
        pipe = diffusers.QwenImagePipeline.from_pretrained(folder)
        pipe.load_lora_weights(str(lora))
        with torch.no_grad():
            packed = pipe(**call, num_inference_steps=2, latents=noise, output_type="latent").images
        return latent_ops.unpack(packed.numpy(), H // 2, W // 2)

    pipe = QwenImagePipeline.from_pretrained(
        folder, ParallelConfig(ulysses=2), compiler_options={"xla_backend_optimization_level": 0}
    )
    run = lambda: pipe(**call, num_inference_steps=2, seed=SEED, output_type="latent", progress=False).latents
    plain = run()
    got = {}
    for name in ("kohya", "comfy", "peft", "lightning", "lightning_ab"):
        pipe.load_lora(str(tmp_path / f"{name}.safetensors"))
        got[name] = run()
        pipe.unload_lora()
    np.testing.assert_allclose(got["comfy"], got["kohya"], rtol=0, atol=1e-6)  # one delta, two layouts
    np.testing.assert_allclose(got["lightning_ab"], got["lightning"], rtol=0, atol=1e-6)
    for name, lora in (("kohya", kohya), ("peft", peft), ("lightning", lightning)):
        want = reference(lora)
        rel = np.linalg.norm(got[name] - want) / np.linalg.norm(want)
        without = np.linalg.norm(plain - want) / np.linalg.norm(want)
        print(f"{name} LoRA vs diffusers: {rel:.2e} relative (without it: {without:.2e})")
        assert rel < LATENT_REL < without, (rel, without)


# ------------------------------------------------------------------ the service


def test_served_picture_matches_diffusers(case):
    """``jaxdit serve``'s engine on the folder (ulysses2): an image request with a negative prompt and
    true_cfg_scale answers diffusers' picture; ``guidance`` is refused by name (no guidance embedding)."""
    import io

    import jax

    from jaxdit import ParallelConfig
    from jaxdit.serve import schema
    from jaxdit.serve.engine import Engine

    config = ParallelConfig(ulysses=2)
    engine = Engine.load(case[0], config.make_mesh(jax.devices()[:2]))
    body = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "true_cfg_scale": CFG, "size": f"{W}x{H}"}
    g = schema.image_request({**body, "steps": STEPS, "seed": SEED}, engine.card)
    png = np.asarray(Image.open(io.BytesIO(engine.generate(g).files[0])), np.float32)
    worst = np.abs(png - case[2] * 255).max()
    print(f"served: PNG {worst:.2f}/255")
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst
    with pytest.raises(schema.RequestError, match="guidance feeds"):
        schema.image_request({**body, "guidance": 3.5}, engine.card)


def test_feature_caches_skip_steps_on_the_joined_sequence(case):
    """First-Block-Cache and TeaCache (explicit coefficients: none are published for Qwen-Image) run with
    the prompts' key mask on a ulysses2 mesh; a loose threshold reuses the residual on some step."""
    from jaxdit import ParallelConfig
    from jaxdit.cache import FirstBlockCache, TeaCache
    from jaxdit.pipelines.qwen_image import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(
        case[0], ParallelConfig(ulysses=2), compiler_options={"xla_backend_optimization_level": 0}
    )
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=4)
    plain = pipe(**call, output_type="latent", progress=False).latents
    with pytest.raises(ValueError, match="no published coefficients"):
        pipe(**call, output_type="latent", progress=False, cache=TeaCache(threshold=0.5))
    for cache in (FirstBlockCache(threshold=10.0), TeaCache(threshold=10.0, coefficients=(1.0, 0.0))):
        out = pipe(**call, output_type="latent", progress=False, cache=cache)
        assert not out.cache.ran.all(), out.cache
        assert np.isfinite(out.latents).all() and not np.array_equal(out.latents, plain)
