"""End to end with the bundled tiny-digits model: same seed, same picture on every mesh; quality; CLI."""

import jax
import numpy as np
import pytest
import tolerance as tol

from jaxdit.generate import GenerateRequest, check_request
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import digits
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.tiny_digits import tiny_digits

# Quick CPU compiles: the programs are tiny, and compile time dominates these tests.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny_pipeline(mesh):
    return tiny_digits(mesh, compiler_options=FAST_COMPILE)


MESHES = {
    "cfg2_ring2_ulysses2": dict(cfg=2, ring=2, ulysses=2),
    "data2_ulysses4": dict(data=2, ulysses=4),  # ulysses4 = all 4 heads split
    "tensor2_cfg2_ulysses2": dict(tensor=2, cfg=2, ulysses=2),
}
CALL = dict(
    negative_prompt="", true_cfg_scale=3.0, height=16, width=16, num_inference_steps=6, seed=7, progress=False
)


def _mesh(degrees):
    config = ParallelConfig(**degrees)
    return config.make_mesh(jax.devices()[: config.num_devices])


@pytest.fixture(scope="module")
def single_device_digits():
    return tiny_pipeline(_mesh({}))("0123456789", **CALL)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_same_seed_same_picture_on_every_mesh(name, single_device_digits):
    out = tiny_pipeline(_mesh(MESHES[name]))("0123456789", **CALL)
    assert out.images.shape == (10, 16, 16)
    tol.check(out.latents, single_device_digits.latents, tol.SAME_SEED, f"{name} vs one device, 6 steps")


@pytest.fixture(scope="module")
def judge():
    return digits.DigitJudge()


def test_generated_digits_are_recognised(judge):
    """The held-out judge labels all 100 samples (10 per class) as the digit asked for (the README's
    claim, measured 100 of 100)."""
    labels = np.repeat(np.arange(10), 10)
    prompt = "".join(map(str, labels))
    record = tiny.training_record()
    # XLA's default optimisation, as jaxdit generate compiles: 100 images x 20 steps take half the CPU
    # time of the -O0 compile the short tests use (measured 8.6 s against 19.1 s).
    out = tiny_digits(_mesh(dict(cfg=2, ring=2, ulysses=2)))(
        prompt,
        negative_prompt="",
        true_cfg_scale=record.get("cfg_scale", 3.0),
        height=16,
        width=16,
        num_inference_steps=record.get("sample_steps", 20),
        seed=1,
        progress=False,
    )
    judged = judge.predict(out.images)
    print(f"judge recognises {int((judged == labels).sum())} of 100 generated digits")
    assert (judged == labels).all(), np.flatnonzero(judged != labels)


def test_bundled_model_is_what_the_readme_says(judge):
    """The README's description of tiny-digits and its judge, number by number."""
    import math

    from jaxdit.models.flux import parameter_shapes

    c = tiny.CONFIG
    assert (c.depth, c.depth_single_blocks, c.hidden_size, c.num_heads, c.mlp_ratio) == (2, 2, 64, 4, 2.0)
    n = sum(math.prod(s) for s in parameter_shapes(c).values())
    assert n == 362_052 and f"{4 * n / 2**20:.1f}" == "1.4"  # parameters; MiB in fp32
    assert tiny.LATENT_SIZE == 16 and (tiny.LATENT_SIZE // 2) ** 2 == 64  # 2x2 patches: 64 image tokens
    tokens, pooled = tiny.LabelEncoder.load()([0, 9])
    assert tokens.shape[1] == tiny.TEXT_TOKENS == 4 and pooled.shape == (2, c.vec_in_dim)
    record = tiny.training_record()
    assert (record["steps"], record["batch"], record["seed"]) == (2000, 64, 0)
    assert (record["sample_steps"], record["cfg_scale"]) == (20, 3.0)
    assert round(record["train_seconds"], -2) == 2100  # measured by scripts/train_tiny.py
    (images, labels), (held_images, _) = digits.load_split()
    assert len(labels) + len(held_images) == 1797 and len(held_images) == round(1797 / 4)
    accuracy = judge.accuracy(images, labels)
    print(f"judge on the generator's real training digits: {accuracy:.1%}")
    # scikit-learn's LogisticRegression solver moves a borderline digit between releases (one digit is
    # 0.07% of 1,348): 95.2% with 1.9.1, 95.1% with the release before it, as the README says.
    assert f"{accuracy:.1%}" in ("95.1%", "95.2%")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(use_cfg_parallel=True, negative_prompt=None, true_cfg_scale=1.0),
            "needs classifier-free guidance",
        ),
        (dict(ulysses_degree=3, emulate_devices=8), "multiply to 3 devices, but 8"),
        (dict(ulysses_degree=8, emulate_devices=8), "4 heads cannot be split over ulysses=8"),
        (dict(height=15), "multiples of 2"),
        (dict(prompt="seven"), "prompt is digits 0-9"),
        (dict(model="flux-dev"), "needs --weights"),
        (dict(model="sd3"), "unknown --model"),
        (dict(warmup_steps=1), "apply to PipeFusion"),
        (dict(output="x.jpg"), "must end in .png"),
        (dict(num_inference_steps=0), "must be >= 1"),
    ],
)
def test_invalid_requests_are_rejected_before_anything_runs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_request(GenerateRequest(**kwargs))


def test_cfg_parallel_step_exchanges_one_prediction():
    """The compiled denoising step holds the model's all-to-alls and one permute of one prediction."""
    from jaxdit import hlo_stats

    pipe = tiny_pipeline(_mesh(dict(cfg=2, ulysses=4)))
    pipe("0123456789", **{**CALL, "num_inference_steps": 1})
    step, args = pipe.last_step
    compiled = step.lower(*args).compile()
    stats = hlo_stats.summarize(compiled)
    permutes = [c for c in hlo_stats.collectives(compiled) if c.kind == "collective-permute"]
    # 64 image + 4 text tokens over ulysses4 -> 16 image tokens per device, 4 features, fp32, 10 images.
    assert len(permutes) == 1 and permutes[0].bytes_per_device == 10 * 16 * 4 * 4
    attention_layers = tiny.CONFIG.depth + tiny.CONFIG.depth_single_blocks
    assert stats["all-to-all"]["count"] == 4 * attention_layers  # Ulysses: q, k, v, out per layer
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        assert stats[kind]["count"] == 0, kind
