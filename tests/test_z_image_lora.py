"""Z-Image LoRAs in the layouts people share, fused by jaxdit on a tensor2 x ulysses2 mesh, against
diffusers' model with the same adapter loaded (``load_lora_adapter``).

One PEFT adapter (random factors, rank 4, alpha 8: scale 2) on every attention projection, the SwiGLU
and the modulations of the tiny transformer (``z_image_tiny.py``) is written by diffusers'
``save_lora_adapter`` (the diffusers layout), and the same factors are rewritten by hand as kohya's
``lora_unet_`` keys with alphas and as ComfyUI's original module tree (q, k, v fused: the three
adapters stacked into one of rank 12 with a block-diagonal up matrix, which is the same update). The
reference reads each file with diffusers' own loader (``ZImagePipeline.lora_state_dict``, its converters
of the non-diffusers layouts). Each file moves the output by far more than the bound, so a wrong mapping
cannot pass.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import lora_tiny
import numpy as np
import pytest
import tolerance as tol
import z_image_tiny as tiny

from converters.lora import read_lora
from converters.safetensors_io import SafetensorsFile, write_safetensors
from jaxdit import load_transformer
from jaxdit.lora import fuse_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig
from jaxdit.models import z_image

SCALE = 0.8
#: Every block's projections and modulation (a regular expression: the final layer's ``adaLN_modulation.0``
#: is its SiLU).
TARGETS = r".*(layers|refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|adaLN_modulation\.0)"
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The forward takes diffusers' own timestep sinusoid (as
    ``test_z_image_transformer.py::test_matches_diffusers_given_its_timestep_features``): its angles reach
    t x 1000 rad, where one ulp of PyTorch's fp32 frequencies moves the output by ~1e-5 relative, more
    than a LoRA mapping error needs to show; so the comparison is held to TORCH_FORWARD."""
    import torch
    from diffusers.models.transformers.transformer_z_image import TimestepEmbedder

    root = tmp_path_factory.mktemp("zimage-lora")
    base = tiny.transformer()
    base.save_pretrained(root / "transformer")
    path = lora_tiny.write_peft(base, root / "peft.safetensors", TARGETS, rank=RANK, alpha=ALPHA)
    x = tiny.inputs([5, 40], 4, 6)
    feats = TimestepEmbedder.timestep_embedding(torch.from_numpy(x[2]) * 1000.0, 256).numpy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(z_image, "time_features", lambda timestep, scale: jnp.asarray(feats))
        fwd = load_transformer(root / "transformer", ParallelConfig(tensor=2, ulysses=2))
        yield root, path, fwd, x, base, tiny.reference(base, *x)


def _diffusers(base, path, x) -> np.ndarray:
    """diffusers' output with the file read by its own loader (``lora_state_dict``: its converters of
    the non-diffusers layouts) and loaded at :data:`SCALE`."""
    from diffusers import ZImagePipeline

    sd, meta = ZImagePipeline.lora_state_dict(str(path), return_lora_metadata=True)
    prefix = "transformer" if any(k.startswith("transformer.") for k in sd) else None
    model = copy.deepcopy(base)
    model.load_lora_adapter(sd, prefix=prefix, metadata=meta, adapter_name="z")
    model.set_adapters(["z"], weights=[SCALE])
    return tiny.reference(model, *x)


def _tensors(path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f}


def _check(case, path, layout: str, reference=None):
    _, _, fwd, x, model, base = case
    want = _diffusers(model, reference or path, x)
    assert read_lora(path, fwd.config).layout == layout
    fused = fuse_loras(fwd.params, fwd.config, [(path, SCALE)])
    try:
        latents, caps, t = x
        got = fwd(latents, t, caps)
    finally:
        unfuse_loras(fwd.params, fused)
    effect = float(np.abs(want - base).max())
    print(f"Z-Image {layout}: the LoRA moves the output by {effect:.3f}")
    assert effect > 100 * tol.TORCH_FORWARD.allowed(np.abs(want).max())
    tol.check(got, want, tol.TORCH_FORWARD, f"Z-Image LoRA ({layout}) vs diffusers")


def test_diffusers_peft(case):
    _check(case, case[1], "diffusers")


def _modules(tensors):
    return sorted({k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")})


def test_kohya(case):
    root, path, *_ = case
    tensors, out = _tensors(path), {}
    for m in _modules(tensors):
        key = "lora_unet_" + m.replace(".", "_")
        out[key + ".lora_down.weight"] = tensors[m + ".lora_A.weight"]
        out[key + ".lora_up.weight"] = tensors[m + ".lora_B.weight"]
        out[key + ".alpha"] = np.float32(ALPHA)
    _check(case, write_safetensors(root / "kohya.safetensors", out), "kohya")


def test_comfyui_original_fused_qkv(case):
    root, path, *_ = case
    tensors, out = _tensors(path), {}
    for m in _modules(tensors):
        if m.endswith(("to_k", "to_v")):
            continue
        down, up = tensors[m + ".lora_A.weight"], tensors[m + ".lora_B.weight"]
        alpha = ALPHA
        if m.endswith("to_q"):
            parts = [m[: -len("to_q")] + n for n in ("to_q", "to_k", "to_v")]
            down = np.concatenate([tensors[p + ".lora_A.weight"] for p in parts])
            ups = [tensors[p + ".lora_B.weight"] for p in parts]
            up = np.zeros((sum(u.shape[0] for u in ups), 3 * RANK), np.float32)
            for i, u in enumerate(ups):
                up[i * u.shape[0] : (i + 1) * u.shape[0], i * RANK : (i + 1) * RANK] = u
            m, alpha = m[: -len("to_q")] + "qkv", 3 * ALPHA  # rank 12: the same alpha / rank
        m = m.replace(".attention.to_out.0", ".attention.out")
        out[f"diffusion_model.{m}.lora_down.weight"] = down
        out[f"diffusion_model.{m}.lora_up.weight"] = up
        out[f"diffusion_model.{m}.alpha"] = np.float32(alpha)
    # diffusers 0.42.1 renames this spelling's fused ``attention.qkv`` to no module of its model and drops
    # it (a warning): the reference is the PEFT file these factors came from, the same update.
    _check(case, write_safetensors(root / "comfy.safetensors", out), "comfyui", reference=path)


def test_lora_of_another_family_is_named(case, tmp_path):
    _, _, fwd, *_ = case
    bad = write_safetensors(
        tmp_path / "flux.safetensors",
        {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": np.zeros((4, 64), np.float32)},
    )
    with pytest.raises(Exception, match="FLUX|flux"):
        read_lora(bad, fwd.config)
