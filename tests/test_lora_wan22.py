"""LoRAs per expert on Wan 2.2 A14B: ``jaxdit generate --lora HIGH --lora_2 LOW`` against diffusers'
``load_lora_weights(HIGH)`` + ``load_lora_weights(LOW, load_into_transformer_2=True)`` + ``fuse_lora`` on the
same tiny two-expert folder (tests/tiny_pipelines.py), and ``load_lora`` / ``unload_lora`` per expert with
the idle expert offloaded to host memory.

The two files are in different layouts: the high-noise expert's written by PEFT + diffusers
(``transformer.`` keys), the low-noise expert's in ComfyUI keys (``diffusion_model.blocks.N...`` with
``lora_down`` / ``lora_up`` + ``.alpha``) built from the expert's original key table. 3 steps at shift 3
run the high-noise expert at step 0 and the low-noise one at steps 1-2, so both LoRAs act.
"""

import copy
import functools

import lora_tiny
import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
import torch
from flax import nnx

from converters.keymap import invert
from converters.lora import LoraError
from converters.safetensors_io import SafetensorsFile, write_safetensors
from converters.wan import diffusers_to_params, original_table
from jaxdit import ParallelConfig, cli
from jaxdit.models.wan import WanConfig
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.wan import WanPipeline
from jaxdit.pipelines.wan_experts import HIGH_NOISE, LOW_NOISE

FAST = {"xla_backend_optimization_level": 0}
PROMPT, NEGATIVE = "a small red cube", "static"
HEIGHT, WIDTH, FRAMES, STEPS, SEED, GUIDANCE, GUIDANCE_2 = 48, 64, 5, 3, 0, 5.0, 3.0
HIGH_SCALE, LOW_SCALE = 3.0, 1.2  # the high-noise expert runs one step of three: a stronger LoRA
PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder, pipe, components = tiny_pipelines.wan22("t2v")
    root = tmp_path_factory.mktemp("lora22")
    high = lora_tiny.write_peft(
        components["transformer"], root / "high.safetensors", PEFT_TARGETS, pipeline=pipe, seed=31
    )
    config = WanConfig.from_diffusers(folder / "transformer_2" / "config.json")
    params = diffusers_to_params(config, components["transformer_2"].state_dict())
    shapes = {k: v.shape for k, v in invert(original_table(config), params).items()}
    modules = [m for m in lora_tiny.linear_modules(shapes) if m.startswith("blocks.")]
    low = lora_tiny.write_kohya_style(
        root / "low.safetensors", shapes, modules, prefix="diffusion_model.", underscore=False, seed=32
    )
    return folder, pipe, components, high, low


def _diffusers_latents(pipe, components, high=None, low=None) -> np.ndarray:
    """diffusers' final latents with ``high`` (file, scale) in ``transformer`` and ``low`` in ``transformer_2``."""
    experts = {name: copy.deepcopy(components[name]) for name in ("transformer", "transformer_2")}
    ref = type(pipe)(**{**components, **experts}, boundary_ratio=pipe.config.boundary_ratio)
    for name, lora, into_2 in (("high", high, False), ("low", low, True)):
        if lora is None:
            continue
        ref.load_lora_weights(str(lora[0]), adapter_name=name, load_into_transformer_2=into_2)
        model = ref.transformer_2 if into_2 else ref.transformer
        model.set_adapters([name], weights=[lora[1]])
        model.fuse_lora(adapter_names=[name])
    shape = (1, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    with torch.no_grad():
        out = ref(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            height=HEIGHT,
            width=WIDTH,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            guidance_scale_2=GUIDANCE_2,
            latents=torch.from_numpy(latent_ops.initial_noise(SEED, shape)),
            max_sequence_length=16,
            output_type="latent",
        ).frames
    return np.asarray(out)


def _quick_compiles(monkeypatch):
    """Quick CPU compiles, as the other pipeline tests (the CLI has no flag for XLA options)."""
    load = WanPipeline.from_pretrained.__func__

    @functools.wraps(load)  # keeps the signature, which jaxdit generate reads
    def quick(cls, *args, **kwargs):
        return load(cls, *args, compiler_options=FAST, **kwargs)

    monkeypatch.setattr(WanPipeline, "from_pretrained", classmethod(quick))


MESHES = {
    "tensor2 x ring2": ["--tensor_parallel_degree", "2", "--ring_degree", "2"],
    # Every step a warm-up step (synchronous): exact, so diffusers is the reference; the LoRAs are fused
    # into both experts' stage layouts.
    "pipefusion2 x ulysses2": [
        "--pipefusion_parallel_degree",
        "2",
        "--ulysses_degree",
        "2",
        "--warmup_steps",
        "3",
    ],
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_generate_with_a_lora_per_expert_matches_diffusers(mesh, files, monkeypatch, tmp_path, capsys):
    folder, pipe, components, high, low = files
    _quick_compiles(monkeypatch)
    out = tmp_path / "latents.npy"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--negative_prompt", NEGATIVE]
    argv += ["--height", str(HEIGHT), "--width", str(WIDTH), "--num_frames", str(FRAMES)]
    argv += ["--steps", str(STEPS), "--seed", str(SEED), "--max_sequence_length", "16"]
    argv += ["--guidance_scale", str(GUIDANCE), "--guidance_scale_2", str(GUIDANCE_2)]
    argv += [*MESHES[mesh], "--output", str(out)]
    argv += ["--lora", f"{high}:{HIGH_SCALE}", "--lora_2", f"{low}:{LOW_SCALE}"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "LoRAs fused into the low-noise expert" in printed
    ours = np.load(out)
    both = _diffusers_latents(pipe, components, (high, HIGH_SCALE), (low, LOW_SCALE))
    high_only = _diffusers_latents(pipe, components, (high, HIGH_SCALE))
    low_only = _diffusers_latents(pipe, components, low=(low, LOW_SCALE))
    # Each expert's LoRA moves the result (so each went where it acts, not into the other expert).
    effect_low, effect_high = float(np.abs(both - high_only).max()), float(np.abs(both - low_only).max())
    print(
        f"Wan 2.2 T2V-A14B, a LoRA per expert ({mesh}): the low-noise LoRA moves the latents by "
        f"{effect_low:.3f}, the high-noise one by {effect_high:.3f}"
    )
    assert min(effect_low, effect_high) > 100 * tol.TORCH_LOOP.allowed(np.abs(both).max())
    tol.check(ours, both, tol.TORCH_LOOP, f"Wan 2.2 T2V-A14B, a LoRA per expert ({mesh}) vs diffusers")


def _params(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _with_a_nan(source, path):
    with SafetensorsFile(source) as f:
        tensors = {k: f.read(k) for k in f}
    key = next(k for k in sorted(tensors) if k.endswith("lora_up.weight"))
    tensors[key] = tensors[key].copy()
    tensors[key].flat[0] = np.nan
    return write_safetensors(path, tensors)


def test_load_and_unload_per_expert_with_the_idle_expert_offloaded(files, tmp_path):
    folder, _, _, high, low = files
    pipe = WanPipeline.from_pretrained(
        folder, ParallelConfig(tensor=2), offload_idle_expert=True, compiler_options=FAST
    )
    experts = pipe.experts
    base = [_params(experts.params(e)) for e in (HIGH_NOISE, LOW_NOISE)]
    assert experts.memory_kinds() == ("pinned_host", "device")  # the low-noise expert was read last
    # A bad file for the offloaded (high-noise) expert is refused before it moves (at full size a 14B
    # expert's copy each way).
    bad = _with_a_nan(low, tmp_path / "nan.safetensors")
    with pytest.raises(LoraError, match="NaN/inf value"):
        pipe.load_lora(bad)
    assert experts.memory_kinds() == ("pinned_host", "device") and pipe.loras is None
    with pytest.raises(TypeError, match="scale must be a number"):
        pipe.load_lora(low, True)  # not load_into_transformer_2
    pipe.load_lora(low, scale=LOW_SCALE, load_into_transformer_2=True)  # brings the low-noise expert in
    assert experts.memory_kinds() == ("pinned_host", "device")
    assert pipe.loras is None and [s for _, s in pipe.loras_2.loras] == [LOW_SCALE]
    fused_low = _params(experts.params(LOW_NOISE))
    untouched = _params(experts.params(HIGH_NOISE))
    assert all(np.array_equal(untouched[k], v) for k, v in base[HIGH_NOISE].items())
    changed = [k for k in base[LOW_NOISE] if not np.array_equal(fused_low[k], base[LOW_NOISE][k])]
    assert changed and all(".kernel" in k for k in changed)
    pipe.load_lora(high, scale=HIGH_SCALE)
    assert [s for _, s in pipe.loras.loras] == [HIGH_SCALE]
    during = [_params(experts.params(e)) for e in (HIGH_NOISE, LOW_NOISE)]
    pipe.unload_lora()
    assert pipe.loras is None and pipe.loras_2 is None
    for e in (HIGH_NOISE, LOW_NOISE):  # each weight back within one rounding of its fused value
        after = _params(experts.params(e))
        for key, value in after.items():
            bound = np.spacing(np.maximum(np.abs(base[e][key]), np.abs(during[e][key])))
            assert np.all(np.abs(value - base[e][key]) <= bound), (e, key)


def test_a_second_expert_lora_needs_two_experts(files, tmp_path, capsys):
    folder, _, _, _, low = files
    wan21, flux = tiny_pipelines.wan_folder(), tiny_pipelines.flux_folder()
    one = WanPipeline.from_pretrained(wan21, ParallelConfig(), compiler_options=FAST)
    with pytest.raises(ValueError, match="only Wan 2.2 A14B has a second"):
        one.load_lora(low, load_into_transformer_2=True)
    capsys.readouterr()  # the folders' writers' progress bars
    for weights in (wan21, flux):  # refused before anything loads, in one line
        argv = ["generate", "--weights", str(weights), "--prompt", PROMPT, "--lora_2", str(low)]
        assert cli.main([*argv, "--output", str(tmp_path / "x.npy")]) == 2
        err = capsys.readouterr().err
        assert "has one transformer: use --lora" in err and len(err.strip().splitlines()) == 1, err
    # Errors name the flag the file came with (which expert it was meant for).
    bad = _with_a_nan(low, tmp_path / "nan.safetensors")
    for arg, needle in (
        (str(bad), f"--lora_2 {bad}: "),
        (f"{low}:abc", f"--lora_2 {low}:abc: the scale 'abc' is not a number"),
        (f"{low}:nan", f"--lora_2 {low}:nan: the scale nan is not a finite number"),
    ):
        argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--lora_2", arg]
        assert cli.main([*argv, "--output", str(tmp_path / "x.npy")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    missing = tmp_path / "missing.safetensors"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--lora_2", str(missing)]
    assert cli.main([*argv, "--output", str(tmp_path / "x.npy")]) == 2
    assert f"--lora_2 {missing}: no such file" in capsys.readouterr().err
