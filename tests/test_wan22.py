"""Wan 2.2 as a variant of the Wan family: per-token timesteps (TI2V), the expert switch (A14B), the two
experts on one compiled step (resident or offloaded), folders, request checks and ``jaxdit plan``'s
memory per device of the presets.

The models are tests/wan_tiny.py's tiny random diffusers ``WanTransformer3DModel`` (8 heads, 2 blocks). The
end-to-end comparisons with diffusers' Wan 2.2 pipelines (prompt to pixels, every variant) are in
tests/test_wan22_pipelines.py; the full-size compiles in tests/test_wan22_fullsize.py.

Per-token timesteps: diffusers' transformer takes a [B, N] timestep and embeds every token's; jaxdit's
forward takes [B] and a per-token 0/1 mask and selects between the embeddings of t and 0. Measured
(2026-12, fp32, outputs up to ~7): max error vs diffusers 2.0e-5 on one device, cfg2 x ulysses4 and
ring2 x ulysses4 (the same model with one timestep per sample: 1.9e-5), sharded vs one device 1.6e-6 /
1.9e-6; held to ``tolerance.TORCH_FORWARD_WAN`` and ``tolerance.SHARDED``. The switch steps at the
released settings, ours and diffusers': T2V-A14B 40 steps, shift 12, boundary 0.875: step 26; I2V-A14B
40 steps, shift 5, 0.9: 15.
"""

import functools
import json

import jax
import numpy as np
import pytest
import tolerance as tol
import wan_tiny
from diffusers import UniPCMultistepScheduler
from PIL import Image

from converters.wan import write_original
from jaxdit.families import load_transformer, open_folder
from jaxdit.families.wan import per_token_timestep
from jaxdit.generate import GenerateRequest, check_request
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan
from jaxdit.models.wan import WanConfig
from jaxdit.pipelines import wan_experts
from jaxdit.pipelines.wan import WanPipeline, check_inputs
from jaxdit.plan.cost import step_cost
from jaxdit.plan.latency import Hardware
from jaxdit.plan.search import evaluate
from jaxdit.plan.workload import Workload
from jaxdit.samplers import unipc

FAST = {"xla_backend_optimization_level": 0}
GB = 1e9


# --------------------------------------------------------------------------------------------------------
# Per-token timesteps (TI2V)
# --------------------------------------------------------------------------------------------------------


@functools.cache
def _per_token_case(shape: str = "f3_6x10", batch: int = 2):
    """diffusers' TI2V call: the first latent frame's tokens at timestep 0, the others at each sample's t."""
    x = dict(wan_tiny.inputs(False, shape, batch))
    f, h, w = wan_tiny.SHAPES[shape]
    tokens = f * (h // 2) * (w // 2)
    first = np.arange(tokens) < (h // 2) * (w // 2)
    x["timestep"] = np.where(first[None], 0, x["timestep"][:, None]).astype(np.int64)  # [B, N]
    return x, wan_tiny.reference(False, x)


@functools.cache
def _per_token_single() -> np.ndarray:
    x, _ = _per_token_case()
    return np.asarray(load_transformer(wan_tiny.diffusers_folder(False), compiler_options=FAST)(**x))


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(), ParallelConfig(cfg=2, ulysses=4), ParallelConfig(ring=2, ulysses=4)],
    ids=ParallelConfig.describe,
)
def test_per_token_timesteps_match_diffusers(parallel):
    x, ref = _per_token_case()
    fn = load_transformer(wan_tiny.diffusers_folder(False), parallel, compiler_options=FAST)
    out = np.asarray(fn(**x))
    single = _per_token_single()
    tol.check(out, ref, tol.TORCH_FORWARD_WAN, f"per-token timesteps on {parallel.describe()} vs diffusers")
    tol.check(out, single, tol.SHARDED, f"per-token timesteps on {parallel.describe()} vs one device")
    # The timestep matters per token: the same call with every token at t differs (first frame moves).
    x_all = dict(x, timestep=x["timestep"].max(axis=1))
    assert np.abs(np.asarray(fn(**x_all)) - out).max() > 1e-3


def test_per_token_timestep_patterns():
    t, mask = per_token_timestep(np.array([[0, 0, 500, 500], [0, 0, 900, 900]]), 2, 4)
    np.testing.assert_array_equal(t, [500, 900])
    np.testing.assert_array_equal(mask, [0, 0, 1, 1])
    assert per_token_timestep(np.array([3.0, 4.0]), 2, 4) == (pytest.approx([3.0, 4.0]), None)
    with pytest.raises(ValueError, match="each sample's t or 0"):
        per_token_timestep(np.array([[0, 100, 500, 500]]), 1, 4)
    with pytest.raises(ValueError, match="same tokens at 0"):
        per_token_timestep(np.array([[0, 5, 5, 5], [5, 0, 5, 5]]), 2, 4)
    with pytest.raises(ValueError, match=r"expected \(1, 4\) video tokens"):
        per_token_timestep(np.zeros((1, 3)), 1, 4)


def test_wan21_forward_has_no_mask_input():
    # Without a mask the program is Wan 2.1's: the forward's inputs present are the same names.
    fn = load_transformer(wan_tiny.diffusers_folder(False), compiler_options=FAST)
    x, _ = wan_tiny.case(False)
    fn(**x)
    (names,) = {names for _, names in fn.forward._steps}
    assert "timestep_mask" not in names


# --------------------------------------------------------------------------------------------------------
# The expert switch
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, shift, boundary",
    [(40, 12.0, 0.875), (40, 5.0, 0.9), (3, 3.0, 0.875), (50, 5.0, 0.9), (4, 12.0, 0.875)],
)
def test_switch_step_equals_diffusers(steps, shift, boundary):
    """diffusers' rule on diffusers' own scheduler: the high-noise expert while t >= boundary x 1000."""
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
    )
    scheduler.set_timesteps(steps)
    theirs = tuple(
        0 if t >= boundary * scheduler.config.num_train_timesteps else 1 for t in scheduler.timesteps
    )
    schedule = unipc.set_timesteps(unipc.UniPCConfig(flow_shift=shift), steps)
    ours = wan_experts.expert_of_steps(schedule.timesteps, boundary, 1000)
    switch = ours.index(1) if 1 in ours else None
    print(
        f"{steps} steps, shift {shift}, boundary {boundary}: switch at step {switch} (diffusers: {theirs.index(1)})"
    )
    assert ours == theirs
    assert 0 in ours and 1 in ours and list(ours) == sorted(ours)
    # The README's released settings: the first low-noise step is 26 of 40 (T2V), 15 of 40 (I2V).
    released = {(40, 12.0, 0.875): 26, (40, 5.0, 0.9): 15}
    if (steps, shift, boundary) in released:
        assert switch == released[steps, shift, boundary]


def test_guidance_per_step_and_bad_boundaries():
    assert wan_experts.guidance_of_steps((0, 0, 1), 4.0, 3.0) == (4.0, 4.0, 3.0)
    for ratio in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"boundary_ratio must lie in \(0, 1\)"):
            wan_experts.expert_of_steps([999], ratio, 1000)


# --------------------------------------------------------------------------------------------------------
# Two experts, one compiled step
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory):
    """Wan-AI's A14B layout from two tiny experts: high_noise_model/ and low_noise_model/ (original
    keys, 2 shards each); the low-noise expert is the tiny model with other weights."""
    root = tmp_path_factory.mktemp("wan22") / "Wan2.2-T2V-tiny-experts"
    high = wan_tiny.state_dict(False)
    rng = np.random.default_rng(7)
    low = {k: v + 0.1 * rng.standard_normal(v.shape).astype(v.dtype) for k, v in high.items()}
    config = wan_tiny.config(False)
    write_original(config, high, root / "high_noise_model", shards=2)
    write_original(config, low, root / "low_noise_model", shards=2)
    return root


def _embeddings(batch: int = 1) -> dict:
    rng = np.random.default_rng(3)
    text = (batch, wan_tiny.text_len(False), wan_tiny.TEXT_DIM)
    return dict(
        prompt_embeds=rng.standard_normal(text).astype(np.float32),
        negative_prompt_embeds=rng.standard_normal(text).astype(np.float32),
    )


CALL = dict(
    height=48, width=80, num_frames=9, num_inference_steps=4, guidance_scale=5.0, guidance_scale_2=2.0
)


def test_two_experts_one_compiled_step_resident_or_offloaded(a14b_folder):
    parallel = ParallelConfig(ring=2, ulysses=2)
    out = {}
    for offload in (False, True):
        pipe = WanPipeline.from_checkpoint(
            a14b_folder, parallel, offload_idle_expert=offload, compiler_options=FAST
        )
        assert pipe.boundary_ratio == 0.875  # the original T2V release's (model_type t2v)
        inputs = pipe.prepare(pipe_request(**CALL)).inputs
        # 4 UniPC steps at shift 3 (480p default): t = 1000, 900, 750, 500 against 875.
        assert inputs.experts == (0, 0, 1, 1) and inputs.scales == (5.0, 5.0, 2.0, 2.0)
        if offload:
            assert pipe.experts.memory_kinds() == ("device", "pinned_host")
        out[offload] = pipe(**_embeddings(), **CALL, output_type="latent", progress=False).latents
        (step,) = pipe.denoiser._steps.values()
        assert step._cache_size() == 1  # both experts ran through ONE compiled step
        if offload:
            # The low-noise expert is on the devices now, the high-noise one in host memory (freed there).
            assert pipe.experts.memory_kinds() == ("pinned_host", "device")
            assert pipe.forward.state is pipe.experts.states[1]
            again = pipe(**_embeddings(), **CALL, output_type="latent", progress=False).latents
            np.testing.assert_array_equal(again, out[True])  # the next call brings the high one back
    np.testing.assert_array_equal(out[False], out[True])
    # The second expert matters: one expert throughout gives another video.
    single = WanPipeline.from_checkpoint(a14b_folder / "high_noise_model", parallel, compiler_options=FAST)
    kwargs = {k: v for k, v in CALL.items() if k != "guidance_scale_2"}
    one = single(**_embeddings(), **kwargs, output_type="latent", progress=False).latents
    assert np.abs(one - out[False]).max() > 1e-3


def pipe_request(**kwargs):
    from jaxdit.pipelines.request import GenerationRequest

    return GenerationRequest(**_embeddings(), **kwargs)


def test_a_two_expert_folder_is_not_converted_as_one_checkpoint(a14b_folder, tmp_path, capsys):
    from jaxdit import cli

    # Before, jaxdit convert of a diffusers A14B pipeline wrote its transformer/ alone, and Wan-AI's
    # folder failed with "no *.safetensors files".
    assert cli.main(["convert", str(a14b_folder), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert "holds Wan 2.2's two experts (high_noise_model/ and low_noise_model/)" in err, err
    assert not (tmp_path / "dst").exists()
    assert cli.main(["convert", str(a14b_folder / "low_noise_model"), str(tmp_path / "dst")]) == 0


def test_converted_experts_go_through_jaxdit_generate(a14b_folder, tmp_path, capsys):
    """Each expert converted by ``jaxdit convert`` and the two folders put side by side, then ``jaxdit
    generate`` of that folder from prompt embeddings, without --model (the T2V kind read from the experts'
    input channels): the latents of the experts' original files, and of the single-device pipeline.
    Before, generate took a folder of the two experts alone for a broken release folder ("missing:
    Wan2.1_VAE.pth, ..."), and any converted folder without --model failed ("no *.safetensors files")."""
    import tolerance as tol

    from jaxdit import cli

    converted = tmp_path / "converted"
    for name in ("high_noise_model", "low_noise_model"):
        assert cli.main(["convert", str(a14b_folder / name), str(converted / name)]) == 0
    np.savez(tmp_path / "embeddings.npz", **_embeddings())
    capsys.readouterr()
    size = [
        "--height",
        str(CALL["height"]),
        "--width",
        str(CALL["width"]),
        "--num_frames",
        str(CALL["num_frames"]),
    ]
    guidance = [
        "--guidance_scale",
        str(CALL["guidance_scale"]),
        "--guidance_scale_2",
        str(CALL["guidance_scale_2"]),
    ]
    out = {}
    for label, weights in (("original", a14b_folder), ("converted", converted)):
        argv = ["generate", "--weights", str(weights), "--prompt_embeds", str(tmp_path / "embeddings.npz")]
        argv += [*size, *guidance, "--steps", str(CALL["num_inference_steps"]), "--ring_degree", "2"]
        assert cli.main([*argv, "--output", str(tmp_path / f"{label}.npy")]) == 0, capsys.readouterr().err
        out[label] = np.load(tmp_path / f"{label}.npy")
    np.testing.assert_array_equal(out["converted"], out["original"])
    pipe = WanPipeline.from_checkpoint(converted, ParallelConfig(), compiler_options=FAST)
    assert pipe.boundary_ratio == 0.875
    one = pipe(**_embeddings(), **CALL, seed=0, output_type="latent", progress=False).latents
    tol.check(out["converted"], one, tol.SAME_SEED, "converted A14B experts, ring2 vs one device")


def test_expert_errors(a14b_folder, tmp_path):
    parallel = ParallelConfig()
    with pytest.raises(ValueError, match="offload_idle_expert applies to two-expert checkpoints"):
        WanPipeline.from_checkpoint(a14b_folder / "high_noise_model", parallel, offload_idle_expert=True)
    with pytest.raises(ValueError, match="wan2.2-t2v-a14b has two experts: give the folder holding both"):
        WanPipeline.from_checkpoint(a14b_folder / "high_noise_model", parallel, preset="wan2.2-t2v-a14b")
    single = WanPipeline.from_checkpoint(a14b_folder / "high_noise_model", parallel, compiler_options=FAST)
    with pytest.raises(ValueError, match="only two-expert Wan 2.2 pipelines"):
        single(**_embeddings(), **CALL, output_type="latent", progress=False)
    # Experts of different architectures cannot share a step; named before any weight is read.
    odd = tmp_path / "odd"
    write_original(wan_tiny.config(False), wan_tiny.state_dict(False), odd / "high_noise_model")
    write_original(wan_tiny.config(True), wan_tiny.state_dict(True), odd / "low_noise_model")
    with pytest.raises(
        ValueError, match=r"must share one architecture; transformer_2 has in_channels=8 \(transformer: 4\)"
    ):
        WanPipeline.from_checkpoint(odd, parallel)


def test_broken_low_noise_expert_is_named_before_any_weight_is_read(a14b_folder, tmp_path, monkeypatch):
    # One mis-shaped tensor in the second expert: the key and its file are named by the header check,
    # before either expert is read (load_model is never reached).
    import shutil

    from converters.errors import CheckpointError
    from converters.safetensors_io import open_checkpoint, write_safetensors
    from jaxdit.pipelines import wan_load

    root = tmp_path / "broken"
    shutil.copytree(a14b_folder, root)
    index = json.loads((root / "low_noise_model/diffusion_pytorch_model.safetensors.index.json").read_text())
    key = "blocks.1.ffn.0.weight"
    shard = root / "low_noise_model" / index["weight_map"][key]
    with open_checkpoint(shard) as f:
        tensors = {k: f.read(k) for k in f}
    tensors[key] = tensors[key][:-1]
    write_safetensors(shard, tensors)
    monkeypatch.setattr(wan_load, "load_model", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(CheckpointError) as info:
        WanPipeline.from_checkpoint(root, ParallelConfig())
    assert key in str(info.value) and shard.name in str(info.value), str(info.value)


# --------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------


def test_check_inputs_for_wan22_variants():
    i2v = WanConfig(dim=96, ffn_dim=40, num_heads=8, num_layers=2, in_channels=36, text_dim=16)  # A14B-like
    ti2v = WanConfig(
        dim=96, ffn_dim=40, num_heads=8, num_layers=2, in_channels=48, out_channels=48, text_dim=16
    )
    ok = dict(
        height=64, width=96, num_frames=5, num_inference_steps=2, guidance_scale=1.0, prompt_embeds=(1, 7, 16)
    )
    latent_i2v = (1, 20, 2, 8, 12)
    plan = check_inputs(i2v, ParallelConfig(), **ok, condition=latent_i2v)
    assert plan.latent_shape == (1, 16, 2, 8, 12) and not plan.first_frame
    with pytest.raises(ValueError, match="needs condition"):
        check_inputs(i2v, ParallelConfig(), **ok)
    with pytest.raises(ValueError, match="has no CLIP image path"):
        check_inputs(i2v, ParallelConfig(), **ok, condition=latent_i2v, image_embeds=(1, 257, 1280))
    t2 = dict(ok, vae_scale_factor_spatial=16, expand_timesteps=True)
    assert not check_inputs(ti2v, ParallelConfig(), **t2).first_frame  # text only
    plan = check_inputs(ti2v, ParallelConfig(), **t2, condition=(1, 48, 1, 4, 6))
    assert plan.first_frame and plan.latent_shape == (1, 48, 2, 4, 6)
    with pytest.raises(ValueError, match=r"TI2V's is the first frame's latent \(1, 48, 1, 4, 6\)"):
        check_inputs(ti2v, ParallelConfig(), **t2, condition=(1, 48, 2, 4, 6))
    with pytest.raises(ValueError, match="height 80 must be a positive multiple of 32.*nearest: 64 or 96"):
        check_inputs(ti2v, ParallelConfig(), **dict(t2, height=64 + 16))
    with pytest.raises(ValueError, match="only two-expert Wan 2.2 pipelines"):
        check_inputs(i2v, ParallelConfig(), **ok, condition=latent_i2v, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match="guidance_scale_2 must be a finite number"):
        check_inputs(
            i2v, ParallelConfig(), **ok, condition=latent_i2v, guidance_scale_2=float("nan"), two_experts=True
        )


# --------------------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------------------


def _index_folder(root, class_name, components, **settings):
    root.mkdir(parents=True)
    models = {"transformer": "WanTransformer3DModel", "transformer_2": "WanTransformer3DModel"}
    models["vae"] = "AutoencoderKLWan"  # the Wan 2.2 VAE too: diffusers' class is the same
    index = {"_class_name": class_name, **{c: ["x", models.get(c, "y")] for c in components}, **settings}
    (root / "model_index.json").write_text(json.dumps(index))
    for c in components:
        (root / c).mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    return root


BASE = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


def test_diffusers_wan22_folders(tmp_path):
    kinds = {
        "ti2v": ("WanPipeline", BASE, dict(expand_timesteps=True), "wan2.2-ti2v"),
        "i2v": ("WanImageToVideoPipeline", (*BASE, "transformer_2"), dict(boundary_ratio=0.9), "wan2.2-i2v"),
        "t2v": ("WanPipeline", (*BASE, "transformer_2"), dict(boundary_ratio=0.875), "wan2.2-t2v"),
    }
    for name, (cls, components, settings, kind) in kinds.items():
        family, folder = open_folder(_index_folder(tmp_path / name, cls, components, **settings))
        assert folder.kind == kind
        assert family.image_input(folder) == {"ti2v": "optional", "i2v": "required", "t2v": "none"}[name]
        assert family.video_fps(folder) == (24 if name == "ti2v" else 16)
    errors = {
        "no transformer_2": (("WanPipeline", BASE, dict(boundary_ratio=0.875)), "has no transformer_2"),
        "no boundary": (("WanPipeline", (*BASE, "transformer_2"), {}), "no boundary_ratio"),
        "bad boundary": (
            ("WanPipeline", (*BASE, "transformer_2"), dict(boundary_ratio=1.5)),
            r"lie in \(0, 1\)",
        ),
        "2.1 i2v without clip": (
            ("WanImageToVideoPipeline", BASE, {}),
            "image_encoder \\(null in model_index",
        ),
    }
    for i, (_what, ((cls, components, settings), message)) in enumerate(errors.items()):
        with pytest.raises(ValueError, match=message):
            open_folder(_index_folder(tmp_path / f"bad{i}", cls, components, **settings))


def _original(root, *, experts=None, model_type="t2v", vae="Wan2.1_VAE.pth", skip=()):
    root.mkdir()
    for name in (vae, "models_t5_umt5-xxl-enc-bf16.pth"):
        (root / name).write_bytes(b"")
    (root / "google" / "umt5-xxl").mkdir(parents=True)
    for sub in experts or [""]:
        if sub not in skip:
            (root / sub).mkdir(exist_ok=True)
            (root / sub / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_original_wan22_folders(tmp_path):
    experts = ["high_noise_model", "low_noise_model"]
    _, t2v = open_folder(_original(tmp_path / "t2v", experts=experts))
    assert (t2v.kind, t2v.layout) == ("wan2.2-t2v", "wan-original")
    assert t2v["transformer_2"].name == "low_noise_model" and t2v.index == {"boundary_ratio": 0.875}
    assert t2v.scheduler_config["flow_shift"] == 12.0  # wan/configs/wan_t2v_A14B.py sample_shift
    _, i2v = open_folder(_original(tmp_path / "i2v", experts=experts, model_type="i2v"))
    assert (i2v.kind, i2v.index, i2v.scheduler_config["flow_shift"]) == (
        "wan2.2-i2v",
        {"boundary_ratio": 0.9},
        5.0,
    )
    _, ti2v = open_folder(_original(tmp_path / "ti2v", model_type="ti2v", vae="Wan2.2_VAE.pth"))
    assert (ti2v.kind, ti2v.index) == ("wan2.2-ti2v", {"expand_timesteps": True})
    assert ti2v["vae"].name == "Wan2.2_VAE.pth" and ti2v["transformer"] == tmp_path / "ti2v"
    with pytest.raises(ValueError, match="missing: low_noise_model"):
        open_folder(_original(tmp_path / "half", experts=experts, skip=("low_noise_model",)))
    with pytest.raises(ValueError, match="model_type 'ti2v' with expert folders"):
        open_folder(_original(tmp_path / "mixed", experts=experts, model_type="ti2v"))


def test_generate_checks_wan22_flags(tmp_path):
    t2v21 = _index_folder(tmp_path / "w21", "WanPipeline", BASE)
    ti2v = _index_folder(tmp_path / "ti2v", "WanPipeline", BASE, expand_timesteps=True)
    i2v = _index_folder(
        tmp_path / "i2v", "WanImageToVideoPipeline", (*BASE, "transformer_2"), boundary_ratio=0.9
    )
    for folder in (t2v21, ti2v, i2v):
        (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
    (ti2v / "vae" / "config.json").write_text(
        json.dumps({"_class_name": "AutoencoderKLWan", "is_residual": True, "patch_size": 2, "z_dim": 48,
                    "in_channels": 12, "out_channels": 12, "decoder_base_dim": 256, "base_dim": 160})
    )  # fmt: skip
    request = lambda **kw: GenerateRequest(**{"prompt": "a", "output": "x.gif", **kw})
    cases = [
        (dict(weights=str(t2v21), guidance_scale_2=3.0), "only Wan 2.2 A14B"),
        (dict(weights=str(t2v21), offload_idle_expert=True), "applies to Wan 2.2 A14B"),
        (dict(weights=str(i2v)), "give --image"),
        (dict(weights=str(ti2v), height=720, width=1280), "multiples of 32"),
        (dict(weights=str(ti2v), model="wan2.2-t2v-a14b"), "does not match"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            check_request(request(**kwargs))
    check_request(request(weights=str(ti2v), height=704, width=1280, num_frames=121, model="wan2.2-ti2v-5b"))
    frame = tmp_path / "frame.png"
    Image.new("RGB", (16, 16)).save(frame)
    check_request(request(weights=str(i2v), image=str(frame), guidance_scale_2=3.0, offload_idle_expert=True))


# --------------------------------------------------------------------------------------------------------
# jaxdit plan: the presets and their memory per device
# --------------------------------------------------------------------------------------------------------


def test_presets_are_the_released_architectures():
    counts = {}
    for name, billions in (
        ("wan2.2-t2v-a14b", 14.288),
        ("wan2.2-i2v-a14b", 14.289),
        ("wan2.2-ti2v-5b", 5.000),
    ):
        cfg = WanConfig.preset(name)
        counts[name] = sum(int(np.prod(s)) for s in wan.parameter_shapes(cfg).values())
        assert round(counts[name] / 1e9, 3) == billions, (name, counts[name])
    assert WanConfig.preset("wan2.2-t2v-a14b") == WanConfig.preset("wan2.1-t2v-14b")  # each expert
    assert WanConfig.preset("wan2.2-ti2v-5b").vae_factors == (4, 16)
    assert WanConfig.preset("wan2.2-i2v-a14b").condition_channels == 20
    assert not WanConfig.preset("wan2.2-i2v-a14b").is_i2v  # no CLIP image path


def test_plan_memory_per_device_counts_resident_experts():
    hw = Hardware(memory_gb=80)
    rows = {}
    for name in ("wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b"):
        for offload in (False, True) if name != "wan2.2-ti2v-5b" else (False,):
            w = Workload.create(name, offload_idle_expert=offload)
            for config in (ParallelConfig(cfg=2, ulysses=4), ParallelConfig(cfg=2, ulysses=2, tensor=2)):
                cost = step_cost(w, config)
                rows[name, offload, config.describe()] = cost
                print(
                    f"{name} {'offload' if offload else 'resident'} {config.describe()}: params "
                    f"{cost.resident_param_bytes / GB:.1f} GB, activations {cost.activation_bytes / GB:.2f} GB, "
                    f"total {cost.memory_bytes / GB:.1f} GB per device"
                )
    t2v = rows["wan2.2-t2v-a14b", False, "cfg2 x ulysses4"]
    off = rows["wan2.2-t2v-a14b", True, "cfg2 x ulysses4"]
    assert t2v.idle_expert_bytes == t2v.param_bytes == off.param_bytes and off.idle_expert_bytes == 0
    assert t2v.memory_bytes - off.memory_bytes == t2v.param_bytes
    assert 57 * GB < t2v.resident_param_bytes < 58.5 * GB  # two 14.29B experts in bf16, fp32 norms
    tensor = rows["wan2.2-t2v-a14b", False, "cfg2 x ulysses2 x tensor2"]
    assert tensor.resident_param_bytes < 0.52 * t2v.resident_param_bytes  # norms, embeddings replicated
    ti2v = rows["wan2.2-ti2v-5b", False, "cfg2 x ulysses4"]
    assert ti2v.idle_expert_bytes == 0 and 9.9 * GB < ti2v.param_bytes < 10.2 * GB
    # Memory decides what fits: one device cannot hold both experts in 80 GB, offloading one would.
    one = evaluate(Workload.create("wan2.2-t2v-a14b"), ParallelConfig(), hw)
    assert not one.fits and any("fits with --offload-idle-expert" in n for n in one.notes)
    with pytest.raises(ValueError, match="no idle expert to offload"):
        Workload.create("wan2.2-ti2v-5b", offload_idle_expert=True)


def test_readme_plan_table():
    """README "Wan 2.2": the table of ``jaxdit plan``'s memory per device, at the digits printed there."""
    configs = {
        "cfg2 x ulysses4": ParallelConfig(cfg=2, ulysses=4),
        "tensor": ParallelConfig(cfg=2, ulysses=2, tensor=2),
    }
    configs["one device"] = ParallelConfig()
    table = {  # (preset, offload): params / total per device, in GB, per configuration
        ("wan2.2-t2v-a14b", False): ("57.9 / 61.5", "29.8 / 34.0", "57.9 / 80.5"),
        ("wan2.2-t2v-a14b", True): ("29.0 / 32.5", "14.9 / 19.1", "29.0 / 51.5"),
        ("wan2.2-i2v-a14b", False): ("57.9 / 61.5", "29.8 / 34.0", "57.9 / 80.5"),
        ("wan2.2-i2v-a14b", True): ("29.0 / 32.5", "14.9 / 19.2", "29.0 / 51.5"),
        ("wan2.2-ti2v-5b", False): ("10.1 / 11.3", "5.2 / 6.5", "10.1 / 17.2"),
    }
    for (name, offload), want in table.items():
        w = Workload.create(name, offload_idle_expert=offload)
        costs = [step_cost(w, c) for c in configs.values()]
        got = tuple(f"{c.resident_param_bytes / GB:.1f} / {c.memory_bytes / GB:.1f}" for c in costs)
        assert got == want, (name, offload)
    per_expert = {"wan2.2-t2v-a14b": "14.29", "wan2.2-i2v-a14b": "14.29", "wan2.2-ti2v-5b": "5.00"}
    for name, billions in per_expert.items():  # parameters per expert: fp32 bytes / 4 of one step's weights
        cost = step_cost(Workload.create(name, dtype="float32"), ParallelConfig())
        assert f"{cost.param_bytes / 4 / 1e9:.2f}" == billions, name


def test_wan22_workload_shapes():
    ti2v = Workload.create("wan2.2-ti2v-5b")
    assert ti2v.size == (704, 1280, 121) and ti2v.steps == 50
    assert ti2v.tokens == (31 * 22 * 40,)  # 121 frames -> 31, 704 x 1280 / 32 -> 22 x 40
    a14b = Workload.create("wan2.2-i2v-a14b")
    assert a14b.tokens == (21 * 45 * 80,) and a14b.context == (512,) and a14b.experts == 2
    with pytest.raises(ValueError, match="multiples of 32"):
        Workload.create("wan2.2-ti2v-5b", height=720)


def test_expert_state_leaves_device_when_offloaded():
    # to_host: the same shards in host memory, the device buffers deleted.
    mesh = ParallelConfig(ulysses=2).make_mesh(jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ulysses"))
    x = jax.device_put(np.arange(8.0, dtype=np.float32), sharding)
    host = wan_experts.to_host({"w": x})
    assert x.is_deleted() and host["w"].sharding.memory_kind == "pinned_host"
    assert wan_experts.to_host(host) is host
    np.testing.assert_array_equal(np.asarray(host["w"]), np.arange(8.0))
