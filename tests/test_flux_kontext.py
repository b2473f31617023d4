"""FLUX.1 Kontext: a tiny ``FluxKontextPipeline`` folder saved by diffusers, from a prompt and a reference
picture to a PNG through ``jaxdit generate`` on meshes, against diffusers running the reloaded folder
with the same initial noise; diffusers' size rules; and the bad inputs refused before any weight loads.

The folder reuses the tiny FLUX components (tests/tiny_pipelines.py: FLUX.1-dev's structure, guidance
embedding, a 2-level VAE of factor 2). A 24 x 32 reference -> 12 x 16 latent -> 48 reference tokens at
RoPE index 1 beside 16 x 20 = ... 8 x 10 = 80 image tokens of a 32 x 40 output. ``--max_area`` 32 * 40
keeps diffusers' rescaled size at 32 x 40 and ``--no_auto_resize`` keeps the reference's (the preferred
resolutions are ~1 megapixel: 65k tokens at this VAE factor).
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_pipelines
from PIL import Image
from pipefusion_helpers import six_step_cache

from jaxdit import cli
from jaxdit.generate import GenerateRequest, check_request
from jaxdit.pipelines import flux_kontext as kontext
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "make the cube red"
H, W, STEPS, SEED = 32, 40, 3, 5
#: Relative L2 error of the final latents, and the largest PNG difference in 1/255 steps.
LATENT_REL, PNG_STEPS = 1e-4, 1.5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, reference PNG, diffusers' final latents [1, C, h, w], diffusers' pixels in [0, 1])."""
    root = tmp_path_factory.mktemp("kontext")
    _, flux_pipe = tiny_pipelines.flux()
    diffusers.FluxKontextPipeline(**flux_pipe.components).save_pretrained(root / "FLUX.1-Kontext-tiny")
    folder = root / "FLUX.1-Kontext-tiny"
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (24, 32, 3), dtype=np.uint8))
    picture.save(root / "reference.png")
    ref = diffusers.FluxKontextPipeline.from_pretrained(folder)
    noise = latent_ops.initial_noise(SEED, (1, 4, H // 2, W // 2))
    call = dict(
        image=picture,
        prompt=PROMPT,
        height=H,
        width=W,
        max_area=H * W,
        _auto_resize=False,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        max_sequence_length=16,
    )
    with torch.no_grad():
        packed = ref(**call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="latent").images
        pixels = ref(**call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="np").images
    latents = latent_ops.unpack(packed.numpy(), H // 2, W // 2)
    return str(folder), str(root / "reference.png"), latents, pixels[0]


def _argv(case, *mesh):
    folder, picture = case[:2]
    argv = ["generate", "--weights", folder, "--prompt", PROMPT, "--image", picture, "--height", str(H)]
    argv += ["--width", str(W), "--max_area", str(H * W), "--no_auto_resize", "--steps", str(STEPS)]
    return argv + ["--max_sequence_length", "16", "--seed", str(SEED), *mesh]


def _check_against_diffusers(case, tmp_path, mesh):
    assert cli.main([*_argv(case, *mesh), "--output", str(tmp_path / "z.npy")]) == 0
    assert cli.main([*_argv(case, *mesh), "--output", str(tmp_path / "edit.png")]) == 0
    latents, png = np.load(tmp_path / "z.npy"), np.asarray(Image.open(tmp_path / "edit.png"), np.float32)
    want_latents, want_pixels = case[2], case[3]
    assert latents.shape == want_latents.shape == (1, 4, H // 2, W // 2)
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    worst = np.abs(png - want_pixels * 255).max()
    print(f"{' '.join(mesh)}: latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert rel < LATENT_REL, rel
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst


def test_cli_kontext_ulysses2_ring2_matches_diffusers(case, tmp_path):
    _check_against_diffusers(case, tmp_path, ["--ulysses_degree", "2", "--ring_degree", "2"])


def test_cli_kontext_pipefusion2_ulysses2_matches_diffusers(case, tmp_path):
    """Every step a warm-up step: PipeFusion's synchronous steps are the serial forward, reference chunks
    carried by the patches like the text."""
    mesh = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)]
    _check_against_diffusers(case, tmp_path, mesh)


# ------------------------------------------------------------------ diffusers' size rules


@pytest.mark.parametrize("size", [(768, 1360), (1000, 1000), (333, 2000), (1600, 900), (17, 40)])
def test_reference_and_output_sizes_are_diffusers(size):
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    assert tuple(PREFERRED_KONTEXT_RESOLUTIONS) == kontext.PREFERRED_RESOLUTIONS
    height, width = size
    aspect = (width - width % 8) / (height - height % 8)
    _, w, h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
    assert kontext.reference_size(height, width, 8) == (h // 16 * 16, w // 16 * 16)
    w2, h2 = round((1024**2 * width / height) ** 0.5), round((1024**2 * height / width) ** 0.5)
    assert kontext.output_size(height, width, 1024**2, 16) == (h2 // 16 * 16, w2 // 16 * 16)


# ------------------------------------------------------------------ bad input, before any weight loads


def _refused(argv, tmp_path, capsys, message):
    out = tmp_path / "never.png"
    assert cli.main([*argv, "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_image_for_a_family_that_takes_none(tmp_path, capsys, case):
    argv = ["generate", "--weights", str(tiny_pipelines.flux_folder()), "--prompt", "a", "--image", case[1]]
    _refused(argv, tmp_path, capsys, "which takes none")


def test_unreadable_and_too_small_reference_images(tmp_path, capsys, case):
    bad = tmp_path.parent / "not-a-picture.png"
    bad.write_text("no pixels here")
    argv = _argv(case)
    at = argv.index("--image") + 1
    _refused([*argv[:at], str(bad), *argv[at + 1 :]], tmp_path, capsys, "is not a picture Pillow can read")
    tiny = tmp_path.parent / "tiny.png"
    Image.new("RGB", (3, 40)).save(tiny)
    _refused([*argv[:at], str(tiny), *argv[at + 1 :]], tmp_path, capsys, "each side needs at least 4")


def test_kontext_folder_without_its_vae(tmp_path, case):
    broken = shutil.copytree(case[0], tmp_path / "kontext", ignore=shutil.ignore_patterns("vae"))
    with pytest.raises(ValueError, match="missing: vae/"):
        check_request(GenerateRequest(weights=str(broken), prompt="a", image=case[1]))


# ------------------------------------------------------------------ checkpoint layouts, LoRA, caches


def test_bfl_and_comfyui_transformers_kohya_lora_and_caches(case, tmp_path):
    """The folder's transformer rewritten in BFL's and ComfyUI's layouts loads to the same model; a
    kohya LoRA (BFL module names) fused on the mesh matches diffusers' ``load_lora_weights`` on the
    reloaded folder; First-Block-Cache and TeaCache run on the joined sequence and skip a step."""
    import lora_tiny
    from safetensors.numpy import load_file

    from converters.flux import bfl_table, diffusers_to_params
    from converters.keymap import invert
    from converters.safetensors_io import write_safetensors
    from jaxdit import ParallelConfig
    from jaxdit.cache import FirstBlockCache, TeaCache
    from jaxdit.models.flux import FluxConfig

    folder, picture = case[0], Image.open(case[1])
    cfg = FluxConfig.from_diffusers(f"{folder}/transformer/config.json")
    weights = {}
    for f in sorted((Path(folder) / "transformer").glob("*.safetensors")):
        weights.update(load_file(f))
    bfl = {k: np.asarray(v) for k, v in invert(bfl_table(cfg), diffusers_to_params(cfg, weights)).items()}
    write_safetensors(tmp_path / "bfl.safetensors", bfl)
    write_safetensors(
        tmp_path / "comfy.safetensors", {"model.diffusion_model." + k: v for k, v in bfl.items()}
    )
    modules = ["double_blocks.0.img_attn.proj", "double_blocks.0.txt_mlp.0", "single_blocks.0.linear2"]
    shapes = {k: v.shape for k, v in bfl.items()}
    lora = lora_tiny.write_kohya_style(
        tmp_path / "kohya.safetensors", shapes, modules, prefix="lora_unet_", underscore=True
    )

    noise = latent_ops.initial_noise(0, (1, 4, H // 2, W // 2))
    call = dict(height=H, width=W, max_area=H * W, num_inference_steps=2, max_sequence_length=16)
    ref = diffusers.FluxKontextPipeline.from_pretrained(folder)
    ref.load_lora_weights(str(lora))
    with torch.no_grad():
        packed = ref(
            image=picture,
            prompt=PROMPT,
            _auto_resize=False,
            latents=torch.from_numpy(latent_ops.pack(noise)),
            output_type="latent",
            **call,
        ).images
    want = latent_ops.unpack(packed.numpy(), H // 2, W // 2)

    def run(pipe, steps=2, **kw):
        return pipe(
            picture,
            PROMPT,
            auto_resize=False,
            output_type="latent",
            progress=False,
            seed=0,
            **{**call, "num_inference_steps": steps},
            **kw,
        )

    fast = {"xla_backend_optimization_level": 0}
    plain = None
    for name in ("bfl", "comfy"):
        pipe = kontext.FluxKontextPipeline.from_pretrained(
            folder,
            ParallelConfig(ulysses=2),
            transformer=tmp_path / f"{name}.safetensors",
            transformer_config=cfg,
            compiler_options=fast,
        )
        out = run(pipe).latents
        plain = out if plain is None else plain
        np.testing.assert_array_equal(out, plain)  # both layouts: the same weights
    without = np.linalg.norm(plain - want) / np.linalg.norm(want)
    pipe.load_lora(str(lora))
    fused = run(pipe).latents
    rel = np.linalg.norm(fused - want) / np.linalg.norm(want)
    print(f"kohya LoRA vs diffusers: {rel:.2e} relative (without the LoRA: {without:.2e})")
    assert rel < LATENT_REL < without
    for cache in (FirstBlockCache(threshold=10.0), TeaCache(threshold=10.0)):
        out = run(pipe, cache=cache, steps=3)
        assert not out.cache.ran.all(), out.cache  # a step reused the residual (TeaCache runs the last one)
        assert np.isfinite(out.latents).all() and not np.array_equal(out.latents, fused)


# ------------------------------------------------------------------ host-planned caches under PipeFusion

#: MagCache (made-up ratios, threshold 0.5, at most 2 skips in a row) and TaylorSeer (interval 2, one
#: warm-up step) over 6 steps under PipeFusion: the plans the host makes (True: every block ran).
KONTEXT_CACHE_PLANS = {"magcache": [1, 0, 0, 1, 0, 0], "taylorseer": [1, 0, 1, 0, 1, 0]}
PF_PATCHES = (
    4  # 2 rows of the 8 x 10 packed image each (20 tokens), a 4-token text and 12-token reference chunk
)


@pytest.fixture(scope="module")
def kontext_pipes(case):
    """(pipefusion2 x ulysses2, one device) Kontext pipelines of the tiny folder."""
    import jax

    from jaxdit import ParallelConfig

    fast = {"xla_backend_optimization_level": 0}
    pc = ParallelConfig(pipefusion=2, ulysses=2)
    pipe = kontext.FluxKontextPipeline.from_pretrained(
        case[0], pc.make_mesh(jax.devices()[:4]), compiler_options=fast
    )
    one = kontext.FluxKontextPipeline.from_pretrained(case[0], ParallelConfig().make_mesh(jax.devices()[:1]))
    return pipe, one


@pytest.mark.parametrize("name", list(KONTEXT_CACHE_PLANS))
def test_host_planned_cache_under_pipefusion_matches_the_serial_reference(
    case, kontext_pipes, tmp_path, name
):
    """pipefusion2 x ulysses2 with MagCache / TaylorSeer vs the serial reference of stale-K/V PipeFusion
    (``flux2_pipefusion_reference.py``, FLUX.1's conditioning) with the same plan. The reference tokens
    (joined after the image along the sequence, never denoised) reach the image through the K/V of the
    full steps and so through the residual kept per patch; a skipped step embeds the patch's tokens,
    adds that residual (TaylorSeer: its forecast) and runs the final layer on the image tokens only,
    with the embedded guidance in its conditioning. The cache moves the result against uncached
    PipeFusion."""
    import tolerance as tol
    from flux2_pipefusion_reference import serial_stale_kv

    from jaxdit.pipelines.request import GenerationRequest

    cache, order = six_step_cache(name, tmp_path)
    pipe, one = kontext_pipes
    call = dict(
        image=Image.open(case[1]), prompt=PROMPT, height=H, width=W, max_area=H * W, auto_resize=False,
        num_inference_steps=6, seed=SEED, max_sequence_length=16, guidance_scale=3.5,
    )  # fmt: skip
    got = pipe(
        num_pipeline_patch=PF_PATCHES,
        warmup_steps=1,
        output_type="latent",
        progress=False,
        cache=cache,
        **call,
    )
    print(f"\n{name}: {got.cache.describe()}")
    plan = KONTEXT_CACHE_PLANS[name]
    np.testing.assert_array_equal(got.cache.ran, np.asarray(plan, bool))
    prepared = one.prepare(one.with_defaults(GenerationRequest.of(**call)))
    context = prepared.inputs.context
    assert context["reference_hidden_states"].shape[1] == 48 and context["guidance"] is not None
    want = prepared.to_latents(
        serial_stale_kv(one, prepared.inputs, PF_PATCHES, tuple(bool(r) for r in plan), order)
    )
    uncached = prepared.to_latents(serial_stale_kv(one, prepared.inputs, PF_PATCHES))
    err = tol.check(
        got.latents, want, tol.PIPEFUSION, f"Kontext {name} pipefusion2 x ulysses2 vs the serial reference"
    )
    drift = tol.max_error(got.latents, uncached)
    print(f"vs the serial reference {err:.1e}; vs uncached PipeFusion {drift:.1e}")
    assert drift > 100 * tol.PIPEFUSION.allowed(np.abs(want).max())


def test_pipefusion_caches_pass_the_cli_and_python_checks_alike(case, kontext_pipes, monkeypatch):
    """``jaxdit generate``'s check (before any weight loads) and ``pipe(..., cache=)`` on a PipeFusion mesh
    take MagCache and TaylorSeer on Kontext and refuse the data-dependent ones; both read the family's
    ``pipefusion_caches`` (the pipeline class's), so a pipeline that drops a cache is refused by both."""
    from jaxdit.generate_cache import check_for_family

    pipe = kontext_pipes[0]

    def request(name):
        return GenerateRequest(weights=case[0], feature_cache=name, pipefusion_parallel_degree=2)

    for name in ("magcache", "taylorseer"):
        check_for_family(request(name), None)
        pipe.check_pipefusion_cache(name)
    for check in (
        lambda: check_for_family(request("fbcache"), None),
        lambda: pipe.check_pipefusion_cache("fbcache"),
    ):
        with pytest.raises(ValueError, match="First-Block-Cache decides each step"):
            check()
    monkeypatch.setattr(kontext.FluxKontextPipeline, "pipefusion_caches", frozenset({"taylorseer"}))
    with pytest.raises(ValueError, match="magcache does not run with PipeFusion on FLUX.1 Kontext"):
        check_for_family(request("magcache"), None)
    with pytest.raises(ValueError, match="magcache does not run with PipeFusion on FluxKontextPipeline"):
        pipe.check_pipefusion_cache("magcache")
