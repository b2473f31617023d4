"""FP8's two quality guards (``jaxdit.models.quantize.FP8``): the first and last steps on the original
weights (``skip_steps``, ``--fp8_skip_steps``) and the block layers a family leaves in its dtype
(``FP8_KEEP``, ``--fp8_keep``).

The skipped steps are checked step by step on the bundled tiny-digits model (fp32 weights, one device):
a run with ``skip_steps=1`` over 4 steps equals, bit for bit, step 0 and step 3 of a run without FP8 and
steps 1 and 2 of a plain FP8 run, each applied to the latents the previous step left; and it compiles one
program per precision, reused by a second call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwen_image_tiny
from flax import nnx

from jaxdit.distributed import fetch
from jaxdit.generate_checks import check_run
from jaxdit.generate_request import GenerateRequest
from jaxdit.mesh import single_device_mesh
from jaxdit.models import qwen_image
from jaxdit.models.quantize import FP8, fp8_layers, quantize_model
from jaxdit.models.qwen_image_config import QwenImageConfig
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.tiny_digits import tiny_digits

FAST_COMPILE = {"xla_backend_optimization_level": 0}
CALL = dict(height=16, width=16, num_inference_steps=4, seed=5, progress=False, output_type="latent")
PROMPT = "0123"


@pytest.fixture(scope="module")
def pipes():
    mesh = single_device_mesh()
    make = lambda fp8: tiny_digits(mesh, compiler_options=FAST_COMPILE, fp8=fp8)
    return {"original": make(None), "fp8": make("weight"), "skip1": make(FP8("weight", skip_steps=1))}


def _stepped(pipes, order: list[str]) -> np.ndarray:
    """The 4 steps run by hand, step n by the pipeline ``order[n]`` names, each from the last's latents."""
    request = pipes["skip1"].with_defaults(GenerationRequest.of(prompt=PROMPT, **CALL))
    inputs = pipes["skip1"].prepare(request).inputs
    first = pipes["original"].denoiser
    layout, names = first.layout(inputs)
    x, state, i, schedule, context, extras, scale = first.place(inputs, layout)
    for name in order:
        denoiser = pipes[name].denoiser
        step = denoiser.step_fn(layout, names, inputs.cfg, inputs.renorm)
        x, state, i, _ = step(denoiser.forward.state, x, state, i, schedule, context, extras, scale)
    return layout.unpad(fetch(x), first.group, axis=1)


def test_skipped_steps_are_the_original_runs_and_the_others_the_fp8_runs(pipes):
    mixed = pipes["skip1"](PROMPT, **CALL).latents
    tokens = lambda order: (
        pipes["skip1"]
        .prepare(pipes["skip1"].with_defaults(GenerationRequest.of(prompt=PROMPT, **CALL)))
        .to_latents(_stepped(pipes, order))
    )
    expected = tokens(["original", "fp8", "fp8", "original"])
    np.testing.assert_array_equal(mixed, expected)
    # Not trivially so: all-FP8 and all-original runs differ from it.
    for other in ("fp8", "original"):
        assert not np.array_equal(mixed, pipes[other](PROMPT, **CALL).latents), other
    # One compiled step per precision, each reused by a second call.
    denoiser = pipes["skip1"].denoiser
    pipes["skip1"](PROMPT, **CALL)
    assert len(denoiser._steps) == 1 and len(denoiser.high_precision._steps) == 1


def test_the_retained_weights_are_the_originals_and_only_skip_steps_retains_them(pipes):
    assert pipes["fp8"].high_precision is None and pipes["fp8"].denoiser.high_precision is None
    forward, steps = pipes["skip1"].high_precision
    assert steps == 1
    for a, b in zip(
        jax.tree.leaves(forward.state), jax.tree.leaves(pipes["original"].forward.state), strict=True
    ):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_too_many_skipped_steps_and_flags_without_fp8_are_refused_before_loading():
    refused = [
        (dict(quantize="fp8", fp8_skip_steps=3, num_inference_steps=4), "use at most 2"),
        (dict(fp8_skip_steps=1), "--fp8_skip_steps 1 applies with --quantize fp8"),
        (dict(fp8_keep="img_mlp"), "--fp8_keep img_mlp applies with --quantize fp8"),
        (dict(quantize="fp8", fp8_skip_steps=1, use_fbcache=True), "feature cache"),
    ]
    for flags, message in refused:
        with pytest.raises(ValueError, match=message):
            check_run(GenerateRequest(prompt="7", emulate_devices=1, **flags))


def _tiny_qwen(keep=None) -> tuple[list[str], list[str]]:
    """(FP8 layers, block layers left in fp32) of a tiny abstract Qwen-Image quantized with ``keep``."""
    model = qwen_image.abstract_model(QwenImageConfig.from_diffusers(qwen_image_tiny.CONFIG), jnp.float32)
    stacked = [name for name, _ in fp8_layers(model, keep=())]
    quantize_model(model, "weight", keep)
    quantized = [name for name, layer in fp8_layers(model, keep=()) if layer.kernel_scale is not None]
    return quantized, sorted(name for name in stacked if name not in quantized)


def test_qwen_image_keeps_its_image_mlp_in_its_dtype_and_a_user_list_replaces_it():
    quantized, kept = _tiny_qwen()
    assert kept == ["transformer_blocks.img_mlp.out", "transformer_blocks.img_mlp.proj"]
    assert "transformer_blocks.txt_mlp.proj" in quantized and "transformer_blocks.to_q" in quantized
    model = qwen_image.abstract_model(QwenImageConfig.from_diffusers(qwen_image_tiny.CONFIG), jnp.float32)
    quantize_model(model, "weight")
    mlp = model.transformer_blocks.img_mlp.proj
    assert mlp.kernel.get_value().dtype == jnp.float32 and mlp.kernel_scale is None
    assert model.transformer_blocks.to_q.kernel.get_value().dtype == jnp.float8_e4m3fn
    # --fp8_keep: the user's list replaces the family's ("none": every block layer in FP8).
    assert _tiny_qwen(())[1] == []
    assert _tiny_qwen(("txt_mlp",))[1] == [
        "transformer_blocks.txt_mlp.out",
        "transformer_blocks.txt_mlp.proj",
    ]
    # Whole path parts only: "mlp" is no layer's name here.
    assert _tiny_qwen(("mlp",))[1] == []
    assert GenerateRequest(fp8_keep="img_mlp, txt_mlp").fp8_keep_layers == ("img_mlp", "txt_mlp")
    assert GenerateRequest(fp8_keep="none").fp8_keep_layers == ()
    assert GenerateRequest().fp8_keep_layers is None


def test_the_planner_prices_the_retained_originals_as_the_run_holds_them(pipes):
    from jaxdit.families import for_config
    from jaxdit.plan.cost import step_cost
    from jaxdit.plan.workload import Workload

    def held(*states) -> int:  # bytes on the device, an array both models share counted once
        arrays = {a.unsafe_buffer_pointer(): a.nbytes for s in states for a in jax.tree.leaves(s)}
        return sum(arrays.values())

    skip1 = pipes["skip1"]
    config = skip1.config
    priced = {
        retained: step_cost(
            Workload.for_config(
                config,
                height=16,
                width=16,
                dtype="float32",
                family=for_config(config),
                fp8=True,
                fp8_retained=retained,
            ),
            skip1.parallel,
        ).param_bytes
        for retained in (False, True)
    }
    assert priced[False] == held(skip1.forward.state)
    both = held(skip1.forward.state, skip1.high_precision[0].state)
    print(
        f"tiny-digits weights: fp8 {priced[False]} B, fp8 + retained originals {both} B (priced {priced[True]})"
    )
    scales = sum(layer.kernel_scale.get_value().nbytes for _, layer in fp8_layers_of(skip1))
    assert 0 <= both - priced[True] <= 2 * scales  # exact but for the scales' bytes


def fp8_layers_of(pipe):
    from flax import nnx

    model = nnx.merge(pipe.forward.graphdef, pipe.forward.state)
    return [(n, m) for n, m in nnx.iter_modules(model) if getattr(m, "kernel_scale", None) is not None]


def test_generate_with_skipped_steps_and_a_keep_list_on_a_mesh(tmp_path, monkeypatch, capsys):
    """``jaxdit generate --quantize fp8 --fp8_skip_steps 1 --fp8_keep double_blocks`` on ring2 x ulysses2:
    the flags reach the pipeline: the double blocks stay fp32, the single blocks go FP8, and the first
    and last step run the original weights."""
    from jaxdit import cli, generate
    from jaxdit.families import FAMILIES

    digits = type(FAMILIES["tiny-digits"])
    bundled = digits.bundled_pipeline

    @functools.wraps(bundled)  # its signature: generate's checks read which options it takes
    def quickly(self, mesh, **options):  # compiled at the LLVM level only: the program is the same
        return bundled(self, mesh, **options, compiler_options=FAST_COMPILE)

    monkeypatch.setattr(digits, "bundled_pipeline", quickly)
    built = []
    build = generate.build
    monkeypatch.setattr(generate, "build", lambda r, mesh: built.append(build(r, mesh)) or built[-1])
    argv = ["generate", "--emulate_devices", "4", "--ring_degree", "2", "--ulysses_degree", "2"]
    argv += ["--prompt", "0123", "--num_inference_steps", "4", "--quantize", "fp8"]
    argv += ["--fp8_mode", "weight", "--fp8_skip_steps", "1", "--fp8_keep", "double_blocks"]
    assert cli.main([*argv, "--output", str(tmp_path / "digits.png")]) == 0
    assert "recognises 4 of 4" in capsys.readouterr().out
    for pipe in built:
        assert pipe.denoiser.high_precision_steps == 1
        model = nnx.merge(pipe.forward.graphdef, pipe.forward.state)
        in_fp8: dict[str, set[bool]] = {}
        for name, layer in fp8_layers(model, keep=()):  # every block layer FP8 could take
            in_fp8.setdefault(name.split(".")[0], set()).add(layer.kernel_scale is not None)
        assert in_fp8 == {"double_blocks": {False}, "single_blocks": {True}}, in_fp8


def test_serve_takes_the_skipped_steps_and_the_keep_list():
    from jaxdit.serve.engine import Engine

    engine = Engine.load(None, single_device_mesh(), quantize="fp8", fp8_mode="weight", fp8_skip_steps=2,
                         fp8_keep="single_blocks")  # fmt: skip
    assert engine.pipe.denoiser.high_precision_steps == 2
    model = nnx.merge(engine.pipe.forward.graphdef, engine.pipe.forward.state)
    in_fp8: dict[str, set[bool]] = {}
    for name, layer in fp8_layers(model, keep=()):
        in_fp8.setdefault(name.split(".")[0], set()).add(layer.kernel_scale is not None)
    assert in_fp8 == {"double_blocks": {True}, "single_blocks": {False}}
    with pytest.raises(ValueError, match="--fp8_skip_steps 1 applies with --quantize fp8"):
        Engine.template_for(None, single_device_mesh(), fp8_skip_steps=1)
