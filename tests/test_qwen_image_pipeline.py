"""Qwen-Image end to end (the issue's done test): a tiny diffusers ``QwenImagePipeline`` folder
(``qwen_image_folder.py``: random weights, saved with ``save_pretrained``) from a prompt and a negative
prompt of another length, with true CFG 4.0, to a PNG through ``jaxdit generate`` on 4 emulated devices,
against diffusers running the reloaded folder with the same initial noise; and the bad inputs refused
before any weight loads. A 32 x 40 picture: a 16 x 20 latent, 8 x 10 = 80 packed tokens; prompts of 10
and 8 real tokens. Bounds: the project's (final latents 1e-4 relative, PNG 1.5/255), errors printed
(``pytest -s``). LoRA, the service, caches and pipelined PipeFusion: ``test_qwen_image_features.py``.
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import qwen_image_folder
from PIL import Image
from qwen_image_folder import CFG, NEGATIVE, PROMPT, SEED, STEPS, H, W

from jaxdit import cli, generate

pytest.importorskip("torch")
pytest.importorskip("diffusers")

LATENT_REL, PNG_STEPS = 1e-4, 1.5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, diffusers' final latents [1, 4, h, w], diffusers' pixels [H, W, 3] in [0, 1])."""
    folder = qwen_image_folder.save(tmp_path_factory.mktemp("qwen_image"))
    return (str(folder), *qwen_image_folder.reference(folder))


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


def test_cli_ulysses2_tensor2_matches_diffusers(case, tmp_path, monkeypatch):
    """Heads and MLP split over tensor=2 (one all-reduce after each row-parallel projection per stream)."""
    _check_against_diffusers(
        case, tmp_path, monkeypatch, ["--ulysses_degree", "2", "--tensor_parallel_degree", "2"]
    )


def test_cli_fp8_with_offloaded_encoder_is_e4m3_rounding(case, tmp_path, monkeypatch):
    """``--quantize fp8 --fp8_mode weight --offload_encoders`` on ulysses2 x tensor2: the blocks' weights
    round to E4M3 (the latents move off diffusers' fp32 ones, by less than one E4M3 step), the encoder's
    weights wait on the host between prompts (the same prompt embeddings: the rest is exact)."""
    folder, want_latents, _ = case
    results = []
    monkeypatch.setattr(generate, "write", lambda r, result: results.append(np.asarray(result.latents)))
    mesh = ["--ulysses_degree", "2", "--tensor_parallel_degree", "2", "--quantize", "fp8"]
    argv = [*_argv(folder, *mesh, "--fp8_mode", "weight", "--offload_encoders")]
    assert cli.main([*argv, "--output", str(tmp_path / "picture.png")]) == 0
    (latents,) = results
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    print(f"fp8 weights, offloaded encoder: latents {rel:.2e} relative to diffusers fp32")
    assert LATENT_REL < rel < 2**-4, rel


def test_data2_tensor2_two_prompts_match_diffusers(case):
    """data=2: each group of devices draws one of two prompts (of different lengths, padded under the mask)
    with its own noise; the CLI draws one picture per run, so this runs the Python call."""
    import diffusers
    import torch

    from jaxdit import ParallelConfig
    from jaxdit.pipelines import latents as latent_ops
    from jaxdit.pipelines.qwen_image import QwenImagePipeline

    folder = case[0]
    prompts, negatives = [PROMPT, "a photo of a small house with a tree"], [NEGATIVE, NEGATIVE]
    noise = latent_ops.initial_noise(SEED, (2, 4, H // 2, W // 2))
    call = dict(prompt=prompts, negative_prompt=negatives, true_cfg_scale=CFG, height=H, width=W)
    ref = diffusers.QwenImagePipeline.from_pretrained(folder)
    with torch.no_grad():
        packed = ref(
            **call,
            num_inference_steps=2,
            latents=torch.from_numpy(latent_ops.pack(noise)),
            output_type="latent",
        ).images
    want = latent_ops.unpack(packed.numpy(), H // 2, W // 2)
    pipe = QwenImagePipeline.from_pretrained(folder, ParallelConfig(data=2, tensor=2))
    got = pipe(**call, num_inference_steps=2, latents=noise, output_type="latent", progress=False).latents
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"data2 x tensor2, 2 prompts: latents {rel:.2e} relative")
    assert got.shape == (2, 4, H // 2, W // 2) and rel < LATENT_REL, rel


def test_cli_pipefusion2_ulysses2_matches_diffusers(case, tmp_path, monkeypatch):
    """Every step a warm-up step: PipeFusion's synchronous steps are the serial forward; the text mask of
    both prompts reaches its patch attention."""
    mesh = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)]
    _check_against_diffusers(case, tmp_path, monkeypatch, mesh)


def test_cli_takes_the_host_planned_caches_with_pipefusion(case, tmp_path):
    """``jaxdit generate --pipefusion_parallel_degree 2 --cache magcache|taylorseer`` on a Qwen-Image
    folder passes the checks made before any weight loads (the runs themselves:
    ``test_qwen_image_features.py``, ``test_qwen_image_edit_strategies.py``); First-Block-Cache is
    still refused with its reason."""
    from jaxdit.cache import magcache
    from jaxdit.generate import GenerateRequest, check_request

    ratios = str(tmp_path / "ratios.json")
    magcache.save_ratios(ratios, np.ones((1, STEPS)))
    mesh = dict(pipefusion_parallel_degree=2, ulysses_degree=2, warmup_steps=1)
    call = dict(weights=case[0], prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=CFG)
    call.update(height=H, width=W, num_inference_steps=STEPS, **mesh)
    for name, flags in (("magcache", dict(magcache_ratios=ratios)), ("taylorseer", {})):
        check_request(GenerateRequest(**call, feature_cache=name, **flags), output=False)
    with pytest.raises(ValueError, match="First-Block-Cache decides each step from block 0's residual"):
        check_request(GenerateRequest(**call, feature_cache="fbcache"), output=False)


# ------------------------------------------------------------------ bad input, before any weight loads


def _refused(argv, tmp_path, capsys, message):
    out = tmp_path / "never.png"
    assert cli.main([*argv, "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_guidance_scale_is_refused(case, tmp_path, capsys):
    """Qwen-Image embeds no guidance scale (as FLUX.1-schnell): the flag would change nothing."""
    _refused(
        [*_argv(case[0]), "--guidance_scale", "3.5"],
        tmp_path,
        capsys,
        "embeds no guidance scale, so it would change nothing",
    )


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
