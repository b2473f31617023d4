"""Qwen-Image end to end: a tiny diffusers ``QwenImagePipeline`` folder (random weights, saved with
``save_pretrained``) from a prompt and a negative prompt of another length, with true CFG 4.0, to a PNG
through ``jaxdit generate`` on 4 emulated devices, against diffusers running the reloaded folder with the
same initial noise; and the bad inputs refused before any weight loads.

The folder: the tiny transformer of ``qwen_image_tiny.py`` with the tiny Qwen2.5-VL's text width (32),
a 2-level ``AutoencoderKLQwenImage`` (factor 2, 4 latent channels, its own latents mean/std), the
word-level tokenizer whose template prefix is 34 tokens (``decoder_lm_tiny.py``), Qwen-Image's scheduler
config (dynamic shift 0.5..0.9 over 256..8192 tokens, terminal 0.02). A 32 x 40 picture: a 16 x 20 latent,
8 x 10 = 80 packed tokens; prompts of 10 and 7 real tokens. Bounds: the project's (final latents 1e-4
relative, PNG 1.5/255), errors printed (``pytest -s``).
"""

from __future__ import annotations

import json
import logging
import shutil

import decoder_lm_tiny
import numpy as np
import pytest
import qwen_image_tiny
from PIL import Image

from jaxdit import cli, generate
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a red car at sunset"
NEGATIVE = "a big dog"
H, W, STEPS, SEED, CFG = 32, 40, 3, 5, 4.0
LATENT_REL, PNG_STEPS = 1e-4, 1.5
SCHEDULER = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def _vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.3, -0.2, 0.1, -0.4],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return vae.eval()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, diffusers' final latents [1, 4, h, w], diffusers' pixels [H, W, 3] in [0, 1])."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("qwen_image")
    parts = root / "parts"
    decoder_lm_tiny.save_qwen_tokenizer(parts / "tokenizer")
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=_vae(),
        text_encoder=decoder_lm_tiny.qwen2_5_vl(),
        tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
        transformer=qwen_image_tiny.transformer(joint_attention_dim=decoder_lm_tiny.TEXT["hidden_size"]),
    )
    folder = root / "Qwen-Image-tiny"
    pipe.save_pretrained(folder)
    ref = diffusers.QwenImagePipeline.from_pretrained(folder)
    noise = latent_ops.initial_noise(SEED, (1, 4, H // 2, W // 2))
    call = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        true_cfg_scale=CFG,
        height=H,
        width=W,
        num_inference_steps=STEPS,
    )
    with torch.no_grad():
        packed = ref(**call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="latent").images
        pixels = ref(**call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="np").images
    return str(folder), latent_ops.unpack(packed.numpy(), H // 2, W // 2), pixels[0]


def _argv(folder, *mesh):
    argv = ["generate", "--weights", folder, "--prompt", PROMPT, "--negative_prompt", NEGATIVE]
    argv += ["--true_cfg_scale", str(CFG), "--height", str(H), "--width", str(W), "--steps", str(STEPS)]
    return argv + ["--seed", str(SEED), *mesh]


def _check_against_diffusers(case, tmp_path, monkeypatch, mesh):
    """One ``jaxdit generate`` run to a PNG; its final latents are read where the run writes its result
    (one run per mesh instead of a second one to a .npy: the compiles dominate this test's time)."""
    folder, want_latents, want_pixels = case
    results = []

    def write(r, result):
        results.append(np.asarray(result.latents))
        return written(r, result)

    written = generate.write
    monkeypatch.setattr(generate, "write", write)
    assert cli.main([*_argv(folder, *mesh), "--output", str(tmp_path / "picture.png")]) == 0
    (latents,) = results
    png = np.asarray(Image.open(tmp_path / "picture.png"), np.float32)
    assert latents.shape == want_latents.shape == (1, 4, H // 2, W // 2)
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    worst = np.abs(png - want_pixels * 255).max()
    print(f"{' '.join(mesh)}: latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert rel < LATENT_REL, rel
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst


def test_cli_cfg2_ulysses2_matches_diffusers(case, tmp_path, monkeypatch):
    _check_against_diffusers(case, tmp_path, monkeypatch, ["--use_cfg_parallel", "--ulysses_degree", "2"])


def test_cli_ulysses2_ring2_matches_diffusers(case, tmp_path, monkeypatch):
    _check_against_diffusers(case, tmp_path, monkeypatch, ["--ulysses_degree", "2", "--ring_degree", "2"])


def test_cli_pipefusion2_ulysses2_matches_diffusers(case, tmp_path, monkeypatch):
    """Every step a warm-up step: PipeFusion's synchronous steps are the serial forward; the text mask of
    both prompts reaches its patch attention."""
    mesh = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)]
    _check_against_diffusers(case, tmp_path, monkeypatch, mesh)


# ------------------------------------------------------------------ bad input, before any weight loads


def _refused(argv, tmp_path, capsys, message):
    out = tmp_path / "never.png"
    assert cli.main([*argv, "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_guidance_scale_is_refused(case, tmp_path, capsys):
    """Qwen-Image embeds no guidance scale (as FLUX.1-schnell): the flag would change nothing."""
    _refused([*_argv(case[0]), "--guidance_scale", "3.5"], tmp_path, capsys, "--guidance_scale feeds")


def test_folders_without_a_qwen_text_encoder_are_refused(case, tmp_path_factory, tmp_path, capsys):
    root = tmp_path_factory.mktemp("broken")
    missing = shutil.copytree(case[0], root / "no-encoder", ignore=shutil.ignore_patterns("text_encoder"))
    _refused(
        _argv(str(missing)), tmp_path, capsys, f"{missing} (QwenImagePipeline) is missing: text_encoder/"
    )
    other = shutil.copytree(case[0], root / "t5-encoder")
    config = other / "text_encoder" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "t5"}))
    _refused(
        _argv(str(other)),
        tmp_path,
        capsys,
        f"a 't5' text encoder; Qwen-Image's is Qwen2.5-VL (model_type 'qwen2_5_vl') in {other / 'text_encoder'}",
    )


def test_one_step_and_long_max_sequence_length_are_refused(case, tmp_path, capsys):
    argv = _argv(case[0])
    steps = argv.index("--steps") + 1
    one = [*argv[:steps], "1", *argv[steps + 1 :]]
    _refused(one, tmp_path, capsys, "--steps 1: this scheduler stretches its schedule to end at sigma 0.02")
    _refused(
        [*argv, "--max_sequence_length", "2000"],
        tmp_path,
        capsys,
        "--max_sequence_length must be in 1..1024 (the prompt tokens Qwen-Image keeps",
    )


def test_a_long_prompt_is_cut_with_a_warning(case, tmp_path, caplog):
    """1030 words + the template's 39 tokens: beyond Qwen-Image's 1024 + 34, cut as diffusers cuts it,
    the count said (the CLI's stderr shows the warning: Python's last-resort handler prints it)."""
    long = " ".join(["cat"] * 1030)
    argv = ["generate", "--weights", case[0], "--prompt", long, "--true_cfg_scale", "1", "--height", "16"]
    argv += ["--width", "16", "--steps", "2", "--output", str(tmp_path / "z.npy")]
    with caplog.at_level(logging.WARNING):
        assert cli.main(argv) == 0
    assert "prompt 0 has 1069 tokens" in caplog.text and "cut to 1058" in caplog.text
    assert np.isfinite(np.load(tmp_path / "z.npy")).all()


def test_masked_text_is_no_key_in_pipelined_pipefusion(case):
    """Past its warm-up PipeFusion attends to stale K/V of other patches, which diffusers has no
    counterpart of; what must still hold exactly is the mask: text tokens a prompt's mask leaves out are
    no key anywhere, fresh or stale, so filling them with large values changes nothing."""
    from jaxdit import ParallelConfig
    from jaxdit.pipelines.qwen_image import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(
        case[0],
        ParallelConfig(pipefusion=2, ulysses=2),
        compiler_options={"xla_backend_optimization_level": 0},
    )
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


# ------------------------------------------------------------------ LoRA layouts


def test_loras_of_every_layout_match_diffusers(case, tmp_path):
    """A kohya LoRA (``lora_unet_`` + underscored module names, alpha), the same factors in ComfyUI's
    layout (``diffusion_model.`` + module names) and a PEFT LoRA written by diffusers, each fused on a
    2-device mesh, against diffusers' ``load_lora_weights`` on the reloaded folder (2 steps with CFG)."""
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
    for name in ("kohya", "comfy", "peft"):
        pipe.load_lora(str(tmp_path / f"{name}.safetensors"))
        got[name] = run()
        pipe.unload_lora()
    np.testing.assert_allclose(got["comfy"], got["kohya"], rtol=0, atol=1e-6)  # one delta, two layouts
    for name, lora in (("kohya", kohya), ("peft", peft)):
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
