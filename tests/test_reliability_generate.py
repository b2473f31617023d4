"""No silent wrong pictures and no work thrown away: non-finite values stop a generation where they first
appear (nothing is decoded or written), and what can be checked before loading is checked first.

Every case asserts the exception (or the CLI's exit code 2), that the message names the problem, and that
nothing was written. The CLI cases run ``jaxdit.cli.main`` as a user would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipelines
from flax import nnx
from PIL import Image
from reliability_support import listing, overflowing_copy

from jaxdit import cli
from jaxdit.cache import FirstBlockCache
from jaxdit.generate import GenerateRequest, check_request
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import finite
from jaxdit.pipelines.finite import NonFiniteError
from jaxdit.pipelines.tiny_digits import tiny_digits

FAST = {"xla_backend_optimization_level": 0}
CALL = dict(
    negative_prompt="", true_cfg_scale=3.0, height=16, width=16, num_inference_steps=3, seed=1, progress=False
)


@functools.cache
def _tiny(**degrees):
    config = ParallelConfig(**degrees)
    return tiny_digits(config.make_mesh(jax.devices()[: config.num_devices]), compiler_options=FAST)


def _set_param(pipe, name: str, fill) -> np.ndarray:
    """Overwrite the parameter whose path ends in ``name`` with ``fill`` (same sharding); returns the old."""
    state, _, _ = pipe.lora_targets()
    for path, var in nnx.to_flat_state(state):
        if ".".join(map(str, path)).endswith(name):
            old = var.get_value()
            var.set_value(jax.device_put(jnp.full(old.shape, fill, old.dtype), old.sharding))
            return old
    raise KeyError(name)


@pytest.fixture
def nan_input_layer():
    """tiny-digits pipelines (one device; cfg2 x ring2 x ulysses2; pipefusion2) whose input projection is
    NaN for the test, restored after it."""
    broken = []

    def corrupt(**degrees):
        pipe = _tiny(**degrees)
        broken.append((pipe, _set_param(pipe, "img_in.kernel", np.nan)))
        return pipe

    yield corrupt
    for pipe, old in broken:
        state, _, _ = pipe.lora_targets()
        for path, var in nnx.to_flat_state(state):
            if ".".join(map(str, path)).endswith("img_in.kernel"):
                var.set_value(old)


@pytest.mark.parametrize("degrees", [{}, dict(cfg=2, ring=2, ulysses=2)])
def test_nan_weights_stop_at_the_transformer_output_of_the_first_step(nan_input_layer, degrees):
    pipe = nan_input_layer(**degrees)
    with pytest.raises(NonFiniteError, match="transformer output at denoising step 1 of 3") as e:
        pipe("0123", **CALL)
    assert e.value.stage == "transformer output" and e.value.step == 1
    assert len(e.value.devices) == max(1, ParallelConfig(**degrees).num_devices)  # every shard is NaN
    assert "nothing was decoded or written" in str(e.value)


def test_the_cached_loop_checks_too(nan_input_layer):
    pipe = nan_input_layer()
    with pytest.raises(NonFiniteError, match="transformer output at denoising step 1"):
        pipe("0123", cache=FirstBlockCache(threshold=0.2), **CALL)


def test_pipefusion_names_the_attention_kv_of_its_warmup(nan_input_layer):
    pipe = nan_input_layer(pipefusion=2)
    with pytest.raises(NonFiniteError, match="K/V at denoising step 1"):
        pipe("0123", num_pipeline_patch=2, **CALL)


def test_decoded_pixels_are_checked():
    pipe = _tiny()
    decode = pipe.decode
    pipe.decode = lambda z: np.full_like(decode(z), np.inf)  # a VAE whose output overflowed
    try:
        with pytest.raises(NonFiniteError, match="VAE decode"):
            pipe("7", **CALL)
    finally:
        pipe.decode = decode


def test_a_healthy_run_passes_the_checks_unchanged():
    """A finite run is not stopped, and the checked step is deterministic from call to call (the second
    call reuses the compiled step). That the flags change no value is what every exactness test of the
    suite, unchanged, shows; that they add no collective, the test below and tests/test_attention_hlo.py."""
    pipe = _tiny(cfg=2, ring=2, ulysses=2)
    first = pipe("0123", **CALL).images
    second = pipe("0123", **CALL).images
    assert np.isfinite(first).all() and np.array_equal(first, second)


def test_flags_are_per_device_rows_without_a_collective():
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    spec = jax.sharding.PartitionSpec(None, ("ring", "ulysses"))
    x = jax.device_put(np.ones((2, 8), np.float32), jax.sharding.NamedSharding(mesh, spec))
    x = x.at[0, 5].set(np.nan)  # in the third shard (columns 4-5)
    hlo = jax.jit(lambda a: finite.shard_flags(mesh, [(a, spec)])).lower(x).compile().as_text()
    assert not any(op in hlo for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute"))
    with pytest.raises(NonFiniteError, match="1 of 4 devices") as e:
        finite.check_flags(finite.array_flags(mesh, [x]), mesh, ["sampler update"], step=2, steps=4)
    assert e.value.devices == (mesh.devices.flat[2].id,)


# ------------------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def flux_folder():
    return tiny_pipelines.flux_folder()


FLUX_ARGS = ["--prompt", "a cube", "--height", "16", "--width", "16", "--steps", "2"]
FLUX_ARGS += ["--max_sequence_length", "8", "--ulysses_degree", "2"]


@pytest.mark.parametrize(
    "component, key, stage",
    [("transformer", "proj_out.weight", "transformer output"), ("vae", "conv_out.weight", "VAE decode")],
)
def test_cli_overflowing_weights_exit_2_naming_the_stage_and_write_nothing(
    flux_folder, tmp_path, capsys, component, key, stage
):
    folder = overflowing_copy(flux_folder, tmp_path / "flux", component, key)
    out = tmp_path / "out" / "cube.png"
    before = listing(tmp_path)
    assert cli.main(["generate", "--weights", str(folder), *FLUX_ARGS, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"first appeared in the {stage}" in err and "nothing was decoded or written" in err
    assert err.count("\n") == 1  # one line, no traceback
    assert listing(tmp_path) == before  # not even the output's folder


# ------------------------------------------------------------------------ checked before any loading


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt="7" * 65), "at most 64 digits"),
        (dict(height=4000, width=4000), "trained on 16x16"),
        (dict(output="/proc/no/such.png"), "cannot write in /proc"),
        (dict(prompt="12\udcff"), "prompt is digits 0-9"),
    ],
)
def test_tiny_requests_refused_before_any_work(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        check_request(GenerateRequest(**kwargs))


def test_tiny_empty_prompt_says_it_draws_one_unconditional_sample(tmp_path, capsys):
    out = tmp_path / "blank.png"
    assert cli.main(["generate", "--prompt", "", "--steps", "1", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "one unconditional sample (the judge does not apply)" in printed and "judge recognises" not in printed
    )
    assert np.asarray(Image.open(out)).shape[:2] == (8 * 16, 8 * 16)  # one picture, drawn 8x


def test_output_that_is_a_folder_or_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a folder"):
        check_request(GenerateRequest(output=str(tmp_path)))
    with pytest.raises(ValueError, match="is a file, so no folder can be made there"):
        check_request(GenerateRequest(output=str(tmp_path / "file" / "x.png")))


def test_tiny_at_another_size_draws_and_skips_the_judge(tmp_path, capsys):
    out = tmp_path / "digits.png"
    assert cli.main(["generate", "--prompt", "37", "--height", "20", "--width", "20", "--steps", "2",
                     "--output", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "reads 16x16 pictures: not run at this size" in printed and out.is_file()


def test_undecodable_prompt_for_a_folder(flux_folder):
    with pytest.raises(ValueError, match=r"not valid UTF-8 text: character 2 is '\\udcff' \(the byte 0xff\)"):
        check_request(GenerateRequest(weights=str(flux_folder), prompt="ab\udcff"))


def test_unreadable_first_frame(tmp_path):
    wan_i2v, _ = tiny_pipelines.wan_i2v()
    bad = tmp_path / "frame.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(ValueError, match="is not a picture Pillow can read"):
        check_request(GenerateRequest(weights=str(wan_i2v), prompt="a", image=str(bad)))


@pytest.mark.parametrize(
    "arrays, message",
    [
        (dict(prompt_embeds=np.full((1, 4, 8), np.nan, np.float32)), "holds 32 NaN/inf"),
        (dict(prompt_embeds=np.ones((1, 4, 8), np.int32)), "is int32; embeddings are floating-point"),
    ],
)
def test_bad_embeddings_named_before_the_checkpoint_loads(tmp_path, arrays, message):
    path = tmp_path / "e.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=message):
        check_request(GenerateRequest(model="flux-dev", weights=str(tmp_path), prompt_embeds=str(path)))


def test_a_request_beyond_the_devices_memory_is_refused_before_loading(flux_folder, capsys):
    argv = ["generate", "--weights", str(flux_folder), "--prompt", "a", "--height", "100000"]
    assert cli.main([*argv, "--width", "100000", "--output", "/tmp/never-written.png"]) == 2
    err = capsys.readouterr().err
    assert "GiB per device" in err and "each device has" in err
    # The advice names only settings not already given (it said "--dtype bfloat16" to a bf16 run, and
    # priced 512 text tokens for --max_sequence_length 8).
    argv += ["--width", "100000", "--dtype", "bfloat16", "--max_sequence_length", "8"]
    assert cli.main([*argv, "--output", "/tmp/never-written.png"]) == 2
    err = capsys.readouterr().err
    assert "--dtype bfloat16" not in err.split("GiB per device")[1] and " 8 + " in err, err


# ------------------------------------------------------------------ the forward callables' arguments


@pytest.fixture(scope="module")
def flux_forward():
    import flux_tiny

    from jaxdit.families import load_transformer

    return load_transformer(flux_tiny.diffusers_folder(False), compiler_options=FAST), flux_tiny


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("encoder_hidden_states", lambda a: a[..., :-1], r"encoder_hidden_states has shape \(1, 7, 31\); this model takes \[B=1, T, 32\]"),
        ("hidden_states", lambda a: a[0], r"hidden_states has shape \(15, 16\); this model takes \[B, N, 16\]"),
        ("pooled_projections", lambda a: np.concatenate([a, a]), r"pooled_projections has shape \(2, 32\); this model takes \[B=1, 32\]"),
    ],
)  # fmt: skip
def test_flux_forward_names_the_argument_and_the_shape_it_takes(flux_forward, name, change, message):
    forward, flux_tiny = flux_forward
    inputs = flux_tiny.inputs(False, batch=1)
    inputs[name] = change(inputs[name])
    with pytest.raises(ValueError, match=message):
        forward(**inputs)


def test_wan_forward_checks_its_text_width_and_image_input():
    import wan_tiny

    from jaxdit.families import load_transformer

    forward = load_transformer(wan_tiny.diffusers_folder(False), compiler_options=FAST)
    inputs = wan_tiny.inputs(False, batch=1)
    text = inputs["encoder_hidden_states"]
    with pytest.raises(ValueError, match=r"encoder_hidden_states has shape \(1, \d+, 15\)"):
        forward(**dict(inputs, encoder_hidden_states=text[..., :-1]))
    with pytest.raises(ValueError, match="has no image input"):
        forward(**dict(inputs, encoder_hidden_states_image=np.zeros((1, 5, 24), np.float32)))


@pytest.mark.parametrize("count", [0, 257, 100000])
def test_emulated_device_counts_are_bounded(count):
    with pytest.raises(ValueError, match=r"--emulate_devices must be in 1\.\.256"):
        check_request(GenerateRequest(emulate_devices=count, ring_degree=max(count, 1)))


# ------------------------------------------------- inputs found by probing (each failed before its fix)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=-1), r"--seed must be >= 0"),  # was numpy's "expected non-negative integer", after loading
        (dict(num_inference_steps=10**9), "--num_inference_steps must be at most 1000"),  # was a hang
        (dict(initialization_timeout=float("nan")), "--initialization_timeout must be > 0"),  # was accepted
        (dict(initialization_timeout=float("inf")), "--initialization_timeout must be > 0"),
        (dict(negative_prompt="345"), "--negative_prompt is one digit or empty"),  # was a late shape error
        (dict(negative_prompt="abc"), "--negative_prompt is one digit or empty"),  # was "its prompt ..."
        (dict(output=""), "--output is empty"),  # wrote digits.png
        (dict(output="  "), "--output is empty"),
    ],
)
def test_probed_tiny_requests_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_request(GenerateRequest(**kwargs))


def test_output_names_the_file_system_cannot_hold(tmp_path):
    """Names over the file system's 255 bytes: a traceback before; a folder to be made, after the run."""
    with pytest.raises(ValueError, match="File name too long"):
        check_request(GenerateRequest(output=str(tmp_path / ("a" * 300 + ".png"))))
    with pytest.raises(ValueError, match="is 256 bytes; .* takes names of at most 255"):
        check_request(GenerateRequest(output=str(tmp_path / "new" / ("b" * 256) / "x.png")))
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")  # a folder on the way that is a broken link
    with pytest.raises(ValueError, match="gone is a symbolic link to nothing"):
        check_request(GenerateRequest(output=str(tmp_path / "gone" / "x.png")))
    assert listing(tmp_path) == ["gone"]


def test_a_name_near_the_limit_is_written(tmp_path):
    """The atomic write's temporary name was the file's plus 14 bytes: 242..255-byte names passed the
    checks and failed after the run."""
    from jaxdit.pipelines.output import save_image

    for stem in ("c" * 250, "\U0001f600" * 62):  # 250 bytes; 248 bytes in 62 characters (cut by bytes)
        path = tmp_path / (stem + ".png")
        check_request(GenerateRequest(output=str(path)))
        save_image(path, np.zeros((2, 2), np.uint8))
        assert path.name in listing(tmp_path)
    assert len(listing(tmp_path)) == 2


@pytest.mark.parametrize(
    "prompt, message",
    [
        (dict(prompt="a \x1b[31mred\x1b[0m cube"), r"--prompt holds the control character U\+001B at character 2"),
        (dict(prompt="a cube", negative_prompt="\x00"), r"--negative_prompt holds the control character U\+0000"),
        (dict(prompt="a\x85cube"), r"U\+0085"),  # C1 controls too
    ],
)  # fmt: skip
def test_control_characters_in_a_prompt(flux_folder, prompt, message):
    with pytest.raises(ValueError, match=message):
        check_request(GenerateRequest(weights=str(flux_folder), **prompt))
    check_request(GenerateRequest(weights=str(flux_folder), prompt="a\tcube\non\r\na table"))  # fine


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data_parallel_degree", "3", "--emulate_devices", "3"], "this run makes 10 picture"),
        (["--prompt", "", "--data_parallel_degree", "2", "--emulate_devices", "2"], "makes 1 picture"),
        (["--guidance_scale", "3"], "tiny-digits has none"),  # was silently ignored
        # Each ran one branch and wrote the picture of the run without it:
        (["--negative_prompt", "3", "--true_cfg_scale", "1"], "--true_cfg_scale 1 turns off"),
    ],
)
def test_probed_cli_runs_refused_before_devices_start(argv, message, tmp_path, capsys, monkeypatch):
    import jaxdit.generate

    monkeypatch.setattr(jaxdit.generate, "start_devices", _no_devices)
    out = tmp_path / "d.png"
    assert cli.main(["generate", *argv, "--steps", "1", "--output", str(out)]) == 2
    assert message in capsys.readouterr().err and listing(tmp_path) == []


def test_true_cfg_without_a_negative_is_refused(flux_folder, tmp_path, capsys, monkeypatch):
    """A FLUX folder with --true_cfg_scale 4 and no negative prompt ran one branch (the same picture)."""
    import jaxdit.generate

    monkeypatch.setattr(jaxdit.generate, "start_devices", _no_devices)
    argv = ["generate", "--weights", str(flux_folder), "--prompt", "a cube", "--true_cfg_scale", "4"]
    assert cli.main([*argv, "--output", str(tmp_path / "x.png")]) == 2
    assert "--true_cfg_scale 4 needs a negative prompt" in capsys.readouterr().err
    assert listing(tmp_path) == []


def test_plan_configs_without_verify_is_refused(capsys):
    assert cli.main(["plan", "--model", "flux-dev", "--devices", "8", "--configs", "ulysses8"]) == 2
    assert "--configs chooses the configurations --verify compiles" in capsys.readouterr().err


def test_folder_data_degree_refused_before_loading(flux_folder, tmp_path, capsys, monkeypatch):
    """It failed after the weights loaded ("1 images cannot be split over data=2")."""
    import jaxdit.generate

    monkeypatch.setattr(jaxdit.generate, "start_devices", _no_devices)
    argv = ["generate", "--weights", str(flux_folder), *FLUX_ARGS, "--data_parallel_degree", "2"]
    assert cli.main([*argv, "--output", str(tmp_path / "x.png")]) == 2
    assert "--data_parallel_degree 2 splits the picture(s)" in capsys.readouterr().err
    assert listing(tmp_path) == []


def _no_devices(r):
    raise AssertionError("devices started: the check came too late")


def test_prompt_of_separators_says_it_draws_an_unconditional_sample(monkeypatch, capsys, tmp_path):
    """',,,' parses to no digit, as '' does; it drew the unconditional sample without saying so."""
    import jaxdit.generate

    class Stop(Exception):
        pass

    def build(r, mesh):
        raise Stop

    monkeypatch.setattr(jaxdit.generate, "build", build)
    with pytest.raises(Stop):
        jaxdit.generate.run(GenerateRequest(prompt=",,,", output=str(tmp_path / "x.png")))
    assert "one unconditional sample" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(seed=-1), "seed must be >= 0"),
        (dict(seed=1.5), "seed must be an integer, got 1.5"),
        (dict(seed=True), "seed must be an integer, got True"),
        (dict(num_inference_steps=2.5), "num_inference_steps must be an integer"),
        (dict(height=16.0), "height must be an integer"),
        (dict(num_images_per_prompt=2.0), "num_images_per_prompt must be an integer"),
        (dict(true_cfg_scale="3"), "true_cfg_scale must be a finite number, got '3'"),
        (dict(callback=5), "callback must be callable"),
    ],
)
def test_probed_pipeline_arguments_named(change, message):
    """numpy's and jax's errors from inside the loop before (or, for a string scale, nothing at all)."""
    from jaxdit.pipelines.request import GenerationRequest

    request = GenerationRequest(prompt="1", height=16, width=16, num_inference_steps=2).replace(**change)
    with pytest.raises(ValueError, match=message):
        request.check()
