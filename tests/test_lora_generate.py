"""LoRAs through the pipelines and the CLI: ``jaxdit generate --lora A --lora B:SCALE`` on a downloaded-layout
tiny FLUX folder, on a tensor x ring mesh, against diffusers' ``load_lora_weights`` + ``fuse_lora`` on the
same folder; ``pipe.load_lora`` / ``unload_lora``; ``jaxdit convert --lora``.

The two files are in different layouts: one written by PEFT + diffusers (``save_lora_weights``), one in
BFL/ComfyUI keys (``diffusion_model.double_blocks...lora_down/lora_up`` + ``.alpha``) built from the
model's BFL key table. The second covers the double blocks only: diffusers' kohya/ComfyUI converter
assumes FLUX.1's sizes for the single blocks' fused ``linear1`` (see tests/lora_tiny.py).
"""

import copy

import lora_tiny
import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
import torch

from converters.flux import bfl_table, diffusers_to_params
from converters.keymap import invert
from converters.lora import LoraError
from jaxdit import ParallelConfig, cli
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.flux import FluxPipeline

PROMPT, HEIGHT, WIDTH, STEPS, SEED = "a small red cube", 32, 48, 3, 5
PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out", "ff.net.2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder, reference = tiny_pipelines.flux()
    root = tmp_path_factory.mktemp("lora")
    peft = lora_tiny.write_peft(
        reference.transformer, root / "peft.safetensors", PEFT_TARGETS, pipeline=reference, seed=3
    )
    config = _config(folder)
    shapes = {
        k: v.shape
        for k, v in invert(
            bfl_table(config), diffusers_to_params(config, reference.transformer.state_dict())
        ).items()
    }
    modules = [m for m in lora_tiny.linear_modules(shapes) if m.startswith("double_blocks.")]
    comfy = lora_tiny.write_kohya_style(
        root / "comfy.safetensors", shapes, modules, prefix="diffusion_model.", underscore=False, seed=4
    )
    return folder, reference, peft, comfy


def _config(folder):
    from jaxdit.models.flux import FluxConfig

    return FluxConfig.from_diffusers(folder / "transformer" / "config.json")


def _diffusers_latents(reference, loras):
    pipe = type(reference)(**{**reference.components, "transformer": copy.deepcopy(reference.transformer)})
    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
    if loras:
        pipe.set_adapters([f"l{i}" for i in range(len(loras))], [s for _, s in loras])
        pipe.fuse_lora()
    h, w = HEIGHT // 2, WIDTH // 2
    noise = latent_ops.initial_noise(SEED, (1, 4, h, w))
    with torch.no_grad():
        packed = pipe(
            PROMPT,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=STEPS,
            guidance_scale=3.5,
            latents=torch.from_numpy(latent_ops.pack(noise)),
            output_type="latent",
            max_sequence_length=8,
        ).images
    return latent_ops.unpack(np.asarray(packed), h, w)


def test_generate_with_two_loras_in_two_layouts_matches_diffusers(files, tmp_path, capsys):
    folder, reference, peft, comfy = files
    loras = [(peft, 0.8), (comfy, 1.2)]
    out = tmp_path / "latents.npy"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--height", str(HEIGHT)]
    argv += ["--width", str(WIDTH), "--steps", str(STEPS), "--seed", str(SEED), "--max_sequence_length", "8"]
    argv += ["--tensor_parallel_degree", "2", "--ring_degree", "2", "--output", str(out)]
    argv += ["--lora", f"{peft}:0.8", "--lora", f"{comfy}:1.2"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "LoRAs fused" in capsys.readouterr().out
    ours = np.load(out)
    ref = _diffusers_latents(reference, loras)
    base = _diffusers_latents(reference, [])
    effect = float(np.abs(ref - base).max())
    print(f"two LoRAs through jaxdit generate (tensor2 x ring2): the LoRAs move the latents by {effect:.3f}")
    assert effect > 100 * tol.TORCH_LOOP.allowed(np.abs(ref).max())
    tol.check(ours, ref, tol.TORCH_LOOP, "two LoRAs through jaxdit generate (tensor2 x ring2) vs diffusers")


def test_load_and_unload_lora_on_a_pipeline(files):
    folder, _, peft, comfy = files
    pipe = FluxPipeline.from_pretrained(
        folder, ParallelConfig(tensor=2), compiler_options={"xla_backend_optimization_level": 0}
    )
    call = dict(
        height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=SEED, output_type="latent", progress=False
    )
    base = pipe(PROMPT, **call).latents
    pipe.load_lora(peft, scale=0.8)
    pipe.load_lora([(comfy, 1.2)])
    assert [s for _, s in pipe.loras.loras] == [0.8, 1.2]
    fused = pipe(PROMPT, **call).latents
    with pytest.raises(LoraError, match="no such file"):
        pipe.load_lora(folder / "missing.safetensors")  # a failed load changes nothing
    assert [s for _, s in pipe.loras.loras] == [0.8, 1.2]
    pipe.unload_lora()
    again = pipe(PROMPT, **call).latents
    assert np.abs(fused - base).max() > 1e-2
    # Every weight back within one fp32 rounding of the fused one: the latents within that rounding's effect.
    tol.check(again, base, tol.ROUNDING, "latents after load_lora + unload_lora vs before")


def test_generate_checks_lora_files_before_loading(files, capsys):
    folder, _, peft, _ = files
    assert (
        cli.main(["generate", "--weights", str(folder), "--prompt", "a", "--lora", "/nowhere.safetensors"])
        == 2
    )
    assert "--lora /nowhere.safetensors: no such file" in capsys.readouterr().err
    assert cli.main(["generate", "--lora", f"{peft}:nan"]) == 2
    assert "not a finite number" in capsys.readouterr().err
    # A FLUX-dev-sized LoRA against the tiny-digits model: named, before anything loads.
    assert cli.main(["generate", "--lora", str(peft)]) == 2
    err = capsys.readouterr().err
    assert str(peft) in err and "shape" in err, err


def test_convert_with_lora_writes_the_fused_weights(files, tmp_path):
    from flax import nnx

    from jaxdit.families import load_params
    from jaxdit.lora import fuse_loras
    from jaxdit.mesh import single_device_mesh

    folder, _, peft, comfy = files
    dst = tmp_path / "fused"
    argv = ["convert", str(folder / "transformer"), str(dst), "--lora", f"{peft}:0.8", "--lora", str(comfy)]
    assert cli.main(argv) == 0
    _, written = load_params(dst, single_device_mesh())
    _, expected = load_params(folder / "transformer", single_device_mesh())
    fuse_loras(expected, expected.config, [(peft, 0.8), comfy])
    flat = lambda m: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    a, b = flat(written), flat(expected)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
