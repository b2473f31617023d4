"""FLUX.2 as a registered family: ``jaxdit plan`` prices its presets with step terms that equal the
compiled forward's FLOPs and parameter bytes, ``jaxdit.load_transformer`` loads a diffusers folder, and
``jaxdit generate`` prices a FLUX.2 [dev] transformer alone as one branch per step."""

from __future__ import annotations

import flux2_tiny as tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol

import jaxdit
from jaxdit import families
from jaxdit.cli import main
from jaxdit.hlo_stats.flops import flops_per_device
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config
from jaxdit.plan import cost
from jaxdit.plan.workload import Workload

TEXT, ROWS, COLS = 5, 4, 6


@pytest.mark.parametrize(
    "pc",
    [ParallelConfig(), ParallelConfig(ulysses=2, tensor=2), ParallelConfig(ring=2, ulysses=2)],
    ids=lambda pc: pc.describe(),
)
def test_step_terms_are_the_compiled_forward(pc):
    """The family's FLOPs (matmuls) and per-device parameter bytes, exactly those of the compiled
    bf16 forward of a tiny FLUX.2 on the mesh."""
    cfg = Flux2Config(**tiny.CONFIG)
    w = Workload.for_config(cfg, height=16 * ROWS, width=16 * COLS, text_tokens=TEXT, dtype="bfloat16")
    terms = families.get("flux2").step_terms(w, pc, cost.shapes(w, pc))
    mesh = pc.make_mesh(jax.devices()[: pc.num_devices])
    forward = flux2.sharded(flux2.abstract_model(cfg, jnp.bfloat16), mesh)
    S, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    lowered = forward.lower(
        hidden_states=S((1, ROWS * COLS, cfg.in_channels), bf16),
        encoder_hidden_states=S((1, TEXT, cfg.joint_attention_dim), bf16),
        timestep=S((1,), f32),
        img_ids=S((ROWS * COLS, 4), f32),
        txt_ids=S((TEXT, 4), f32),
        guidance=S((1,), f32),
    )
    flops = terms.nonblock_flops + sum(d * f for d, f in zip(w.stack_depths, terms.block_flops, strict=True))
    params = terms.param_nonblock_bytes + sum(
        d * p for d, p in zip(w.stack_depths, terms.param_block_bytes, strict=True)
    )
    assert flops_per_device(lowered.compile()) == flops
    assert forward.param_bytes_per_device() == params


def test_plan_prices_the_presets(capsys):
    for name, params in (("flux2-dev", 32.22e9), ("flux2-klein-4b", 3.88e9), ("flux2-klein-9b", 9.08e9)):
        cfg = families.get("flux2").preset_config(name)
        total = sum(int(np.prod(s)) for s in flux2.parameter_shapes(cfg).values())
        assert abs(total - params) < 0.01e9, (name, total)
    assert main(["plan", "--model", "flux2-dev", "--devices", "8"]) == 0
    text = capsys.readouterr().out
    # 512 text + 64 x 64 image tokens; ulysses8 holds every weight: 32.2 B parameters in bf16.
    assert "flux2-dev 1024x1024: 512 + 4096 tokens, no CFG" in text
    assert "ulysses8" in text and "64.4 GB" in text


def test_generate_prices_a_flux2_dev_checkpoint_as_one_branch(tmp_path, capsys):
    """A FLUX.2 [dev] transformer alone (``--model flux2-dev``, guidance 4 by default) is priced as dev's
    pipeline runs it, one branch per step, and the full-size model is refused on one CPU device by the
    memory check before any weight is read (tests/test_flux2_bfl.py runs a tiny one)."""
    (tmp_path / "w").mkdir()
    embeds = tmp_path / "e.npz"
    np.savez(embeds, prompt_embeds=np.zeros((1, TEXT, 15360), np.float32))
    argv = [
        "generate",
        "--model",
        "flux2-dev",
        "--weights",
        str(tmp_path / "w"),
        "--prompt_embeds",
        str(embeds),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "1024x1024: 5 + 4096 tokens, no CFG" in err, err


def test_load_transformer_reads_a_diffusers_folder(tmp_path):
    model = tiny.transformer(seed=2)
    model.save_pretrained(tmp_path / "transformer")
    x = tiny.inputs(1, TEXT, (ROWS, COLS), ((2, 2),), seed=2)
    forward = jaxdit.load_transformer(tmp_path, ParallelConfig(ulysses=2))
    assert families.detect_family(tmp_path).name == "flux2"
    # A BFL file is FLUX.2's, not FLUX.1's: both hold img_in.weight, only FLUX.1 modulates per block, so
    # FLUX.1's detection refuses it whatever order the families are tried in.
    from converters.flux import is_flux_checkpoint
    from converters.flux2 import bfl_table, diffusers_to_params
    from converters.keymap import invert
    from converters.safetensors_io import write_safetensors

    cfg = Flux2Config(**tiny.CONFIG)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    bfl = invert(bfl_table(cfg), diffusers_to_params(cfg, sd))
    for prefix in ("", "model.diffusion_model."):
        path = write_safetensors(
            tmp_path / f"bfl{len(prefix)}.safetensors", {prefix + k: v for k, v in bfl.items()}
        )
        assert families.detect_family(path).name == "flux2"
        assert not is_flux_checkpoint(path)
    got = np.asarray(forward(**x))
    tol.check(got, tiny.reference(model, x), tol.TORCH_FORWARD, "load_transformer")
    # jaxdit convert -> an orbax folder that loads to the same forward, bit for bit.
    converted = families.convert_checkpoint(tmp_path, tmp_path / "orbax")
    assert families.detect_family(converted).name == "flux2"
    again = jaxdit.load_transformer(converted, ParallelConfig(ulysses=2))
    assert np.array_equal(np.asarray(again(**x)), got)
