"""HunyuanVideo 1.5 image-to-video: the SigLIP image encoder against transformers' ``SiglipVisionModel``,
the picture arithmetic (size bucket, crop, SigLIP processor) against diffusers' and transformers', and the
tiny ``HunyuanVideo15ImageToVideoPipeline`` folder saved by diffusers (``hunyuan_video15_folder.py``) from
a prompt and a first frame to an MP4 through ``jaxdit generate`` on ulysses2 x ring2, cfg2 x ulysses2 and
pipefusion2 x ulysses2 (4 emulated devices; PipeFusion's default 3 patches, one latent row of each frame,
every step a warm-up step: diffusers' computation), against diffusers running the reloaded folder with the project's noise (numpy
``default_rng(seed).standard_normal`` of [1, 4, F', H/16, W/16]); diffusers' reference is computed once."""

from __future__ import annotations

import av
import hunyuan_video15_folder as hf
import jax
import numpy as np
import pytest
import tolerance as tol
import torch
from PIL import Image

from jaxdit import cli
from jaxdit import generate as generate_module
from jaxdit.loading.hunyuan_video15 import load_hunyuan_video15_image_encoder
from jaxdit.pipelines import hunyuan_video15_i2v as i2v_pipeline
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.hunyuan_video15 import TimestepEuler
from jaxdit.pipelines.hunyuan_video15_i2v import picture_size
from jaxdit.pipelines.hunyuan_video15_image import SiglipProcessor, crop_to, rgb_pictures
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.vae.hunyuan_video15_vae_mesh import HunyuanVideo15MeshVAE as HunyuanMeshVAE

PROMPT = 'a cat walks on grass, sign reading "hello"'
FRAMES, STEPS, SEED = 5, 3, 5
PICTURE = (40, 56)  # height, width: bucketed to 48 x 64 at the tiny transformer's target size 64
FAST = {"xla_backend_optimization_level": 0}


def _picture(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*PICTURE, 3), dtype=np.uint8)


def test_siglip_matches_transformers(tmp_path):
    parts = hf.image_components()
    parts["image_encoder"].save_pretrained(tmp_path / "image_encoder")
    model = load_hunyuan_video15_image_encoder(tmp_path / "image_encoder")
    s = hf.SIGLIP["image_size"]
    pixels = np.random.default_rng(1).uniform(-1, 1, (2, 3, s, s)).astype(np.float32)
    with torch.no_grad():
        want = parts["image_encoder"](pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()
    got = np.asarray(jax.jit(lambda x: model(x))(pixels))
    assert got.shape == want.shape == (2, (s // hf.SIGLIP["patch_size"]) ** 2, hf.SIGLIP["hidden_size"])
    tol.check(got, want, tol.TORCH_FORWARD, "SigLIP vision last_hidden_state vs transformers")


@pytest.mark.parametrize("shape", [PICTURE, (64, 30), (50, 50)])
def test_picture_arithmetic_matches_diffusers(shape):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    parts = hf.image_components()
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16, do_resize=False, do_convert_rgb=True)
    picture = np.random.default_rng(2).integers(0, 256, (*shape, 3), dtype=np.uint8)
    size = picture_size(shape, hf.TRANSFORMER["target_size"])
    assert size == tuple(processor.calculate_default_height_width(*shape, hf.TRANSFORMER["target_size"]))
    want_crop = np.asarray(processor.resize(Image.fromarray(picture), *size, resize_mode="crop"))
    got_crop = crop_to(picture, *size)
    assert np.array_equal(rgb_pictures(Image.fromarray(picture).convert("RGBA")), picture[None])
    assert np.array_equal(got_crop, want_crop)
    want = parts["feature_extractor"].preprocess(images=Image.fromarray(got_crop), return_tensors="np")
    got = SiglipProcessor(parts["feature_extractor"].to_dict())(got_crop[None])
    tol.check(got, want["pixel_values"], tol.ROUNDING, "SigLIP processor pixel values vs transformers")


def _folder_and_reference(root, **transformer):
    """The folder (``transformer``: overrides of its transformer's config), the first frame's file, and
    diffusers' final latents and frames; and diffusers' pipeline (``seen_r``: the ``timestep_r`` of
    its transformer calls) and the noise."""
    import diffusers

    folder = root / "HunyuanVideo-1.5-i2v-tiny"
    hf.save_i2v(folder, **transformer)
    picture = root / "first.png"
    Image.fromarray(_picture()).save(picture)
    pipe = diffusers.HunyuanVideo15ImageToVideoPipeline.from_pretrained(folder)
    pipe.seen_r = []  # the timestep_r of every transformer call

    def record(module, args, kwargs):
        r = kwargs.get("timestep_r")
        pipe.seen_r.extend([None] if r is None else r.tolist())

    pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    h, w = picture_size(PICTURE, hf.TRANSFORMER["target_size"])
    noise = latent_ops.initial_noise(SEED, (1, 4, (FRAMES - 1) // 4 + 1, h // 16, w // 16))
    with torch.no_grad():
        latents = pipe(
            image=Image.open(picture),
            prompt=PROMPT,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            latents=torch.from_numpy(noise),
            output_type="latent",
        ).frames
        video = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
    return (folder, picture, latents.numpy(), frames, (h, w)), (pipe, noise)


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    """The folder, the first frame's file, and diffusers' final latents and frames."""
    return _folder_and_reference(tmp_path_factory.mktemp("hy-i2v"))[0]


def _generate(case, mesh, monkeypatch, tmp_path):
    """``jaxdit generate`` of the folder and picture of ``case`` on ``mesh``, compared with diffusers'
    latents and frames; returns the latents."""
    folder, picture, want_latents, want_frames, (h, w) = case
    seen, write = {}, generate_module.write

    def capture(r, result):
        seen["result"] = result
        return write(r, result)

    monkeypatch.setattr(generate_module, "write", capture)
    pipeline = i2v_pipeline.HunyuanVideo15ImageToVideoPipeline
    loads = pipeline.from_pretrained.__func__

    def quick(cls, *args, **kwargs):  # XLA's backend optimisations off: compiles in a fraction of the time
        return loads(cls, *args, **{**kwargs, "compiler_options": FAST})

    monkeypatch.setattr(pipeline, "from_pretrained", classmethod(quick))
    encodes, encode = [], HunyuanMeshVAE.encode

    def spy(self, x, mesh=None):  # the first frame's encode: over how many devices
        encodes.append(self.tiles(mesh).size)
        return encode(self, x, mesh)

    monkeypatch.setattr(HunyuanMeshVAE, "encode", spy)
    out = tmp_path / "hy.mp4"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--image", str(picture)]
    argv += ["--num_frames", str(FRAMES), "--steps", str(STEPS), "--seed", str(SEED), *mesh]
    assert cli.main([*argv, "--output", str(out)]) == 0
    result, label = seen["result"], " ".join(mesh)
    assert encodes == [4]  # the first frame encoded row-parallel over the 4 devices, as the decode
    tol.check(result.latents, want_latents, tol.TORCH_LOOP, f"jaxdit generate i2v {label}: final latents")
    frames = np.clip((np.asarray(result.images) + 1) / 2, 0, 1)
    assert frames.shape == want_frames.shape == (1, FRAMES, h, w, 3)
    tol.check(frames, want_frames, tol.PIXELS["hunyuanvideo1.5_i2v"], f"jaxdit generate i2v {label}: frames")
    with av.open(str(out)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert (len(decoded), *decoded[0].shape) == (FRAMES, h, w, 3)
    return result.latents


@pytest.mark.parametrize(
    "mesh",
    [
        ("--ulysses_degree", "2", "--ring_degree", "2"),
        ("--use_cfg_parallel", "--ulysses_degree", "2"),
        ("--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)),
    ],
)
def test_cli_image_to_mp4_matches_diffusers(i2v, mesh, monkeypatch, tmp_path):
    _generate(i2v, mesh, monkeypatch, tmp_path)


def test_cli_meanflow_image_to_mp4_matches_diffusers(tmp_path_factory, monkeypatch, tmp_path):
    """A MeanFlow (``use_meanflow``) folder on cfg2 x ulysses2: diffusers' image-to-video pipeline passes
    the next step's timestep as ``timestep_r`` (0 at the last step), and so does jaxdit's loop
    (``TimestepEuler.next_time``). That the term moves the output by far more than the bound is checked
    on the model (``test_hunyuan_video15_transformer.py``)."""
    case, (pipe, _) = _folder_and_reference(tmp_path_factory.mktemp("hy-i2v-mf"), use_meanflow=True)
    _generate(case, ("--use_cfg_parallel", "--ulysses_degree", "2"), monkeypatch, tmp_path)
    timesteps = pipe.scheduler.timesteps.numpy()  # the schedule of the reference run
    want_r = [*timesteps[1:], 0.0]
    assert [float(r) for r in pipe.seen_r] == [float(r) for r in want_r for _ in range(2)]  # 2 branches
    config = euler.FlowMatchEulerConfig(shift=hf.SHIFT)
    schedule = euler.set_timesteps(config, sigmas=np.linspace(1.0, 0.0, STEPS + 1)[:-1], mu=None)
    got_r = [float(TimestepEuler(config).next_time(schedule, i)) for i in range(STEPS)]
    np.testing.assert_array_equal(got_r, np.asarray(want_r, np.float32))


def test_cli_refuses_another_size(i2v, tmp_path, capsys):
    folder, picture, *_ = i2v
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--image", str(picture)]
    assert cli.main([*argv, "--height", "32", "--width", "32", "--output", str(tmp_path / "x.mp4")]) == 2
    assert "size bucket 48x64" in capsys.readouterr().err
    assert not (tmp_path / "x.mp4").exists()


def test_plan_prices_the_image_tokens():
    from jaxdit.plan.workload import Workload

    t2v, i2v = Workload.create("hunyuanvideo1.5-480p"), Workload.create("hunyuanvideo1.5-480p-i2v")
    assert t2v.tokens == (31 * 30 * 53, 1000, 256)  # 121 frames of 480 x 848: (video, prompt, glyph)
    assert i2v.tokens == (*t2v.tokens, 729)  # + the first frame's SigLIP tokens
    assert i2v.family.name == "hunyuan-video15-i2v"


def test_conditioning_given_without_encoders_is_checked():
    """A bare pipeline (``jaxdit plan --verify``'s, no VAE encoder or SigLIP) takes ``image_embeds`` and
    ``condition`` in place of the picture; the wrong ones are refused before the step is built."""
    from jaxdit.families.hunyuan_video15_i2v import HUNYUAN_VIDEO15_I2V
    from jaxdit.mesh import ParallelConfig
    from jaxdit.models import hunyuan_video15 as hv
    from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config
    from jaxdit.pipelines.request import GenerationRequest

    c = HunyuanVideo15Config(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_refiner_layers=1, text_embed_dim=8, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    mesh = ParallelConfig().make_mesh(jax.devices()[:1])
    pipe = HUNYUAN_VIDEO15_I2V.bare_pipeline(hv.abstract_model(c), mesh)
    base = dict(
        prompt_embeds=np.zeros((1, 3, 8), np.float32),
        prompt_embeds_mask=np.ones((1, 3), np.int64),
        prompt_embeds_2=np.zeros((1, 2, 8), np.float32),
        prompt_embeds_mask_2=np.ones((1, 2), np.int64),
        height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
    )  # fmt: skip
    embeds, condition = np.zeros((1, 7, 12), np.float32), np.zeros((1, 5, 2, 2, 3), np.float32)
    prepared = pipe.prepare(GenerationRequest.of(**base, image_embeds=embeds, condition=condition))
    assert prepared.inputs.context["image_embeds"].shape == (1, 7, 12)
    assert prepared.inputs.extras["condition"].shape == (1, 2 * 2 * 3, 5)
    for bad, says in [
        (dict(image_embeds=embeds), "needs image, or image_embeds and condition"),
        (dict(image=_picture()), "no VAE encoder and image encoder"),
        (dict(image=_picture(), image_embeds=embeds, condition=condition), "not both"),
        (
            dict(image_embeds=embeds, condition=condition[:, :, :1]),
            r"this request needs \[B, \*\(5, 2, 2, 3\)\]",
        ),
        (dict(image_embeds=embeds[0], condition=condition), "image_embeds has shape"),
    ]:
        with pytest.raises(ValueError, match=says):
            pipe.prepare(GenerationRequest.of(**base, **bad))
