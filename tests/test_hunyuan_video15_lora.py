"""HunyuanVideo 1.5 LoRAs in diffusers' (PEFT) layout and in the layouts of ComfyUI, Tencent's checkpoint
and kohya (``hunyuan_video15_lora_layouts.py``), fused by jaxdit on a tensor2 x ulysses2 mesh,
against diffusers' ``HunyuanVideo15Transformer3DModel`` with the same file loaded by its own
``load_lora_adapter`` (the transformer is a ``PeftAdapterMixin``; diffusers 0.42 has no LoRA loader for
the HunyuanVideo 1.5 pipelines). The tiny model of ``hunyuan_video15_tiny.py``, image-to-video inputs (so
the SigLIP projection's LoRA acts too).

One PEFT adapter (random factors, rank 4, alpha 8: scale 2) on every Linear and on the patch embedding's
Conv3d, written by diffusers' ``save_lora_adapter``; the same factors again under ``transformer.`` with
``.alpha`` keys and no PEFT header (how hand-made and converted files come). Each file moves the output by
far more than the bound, so a wrong mapping cannot pass.
"""

from __future__ import annotations

import copy
import json

import hunyuan_video15_lora_layouts as layouts
import hunyuan_video15_tiny as tiny
import lora_tiny
import numpy as np
import pytest
import tolerance as tol
import torch

from converters.lora import LoraError, read_lora
from converters.safetensors_io import SafetensorsFile, write_safetensors
from jaxdit import load_transformer
from jaxdit.lora import fuse_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig

pytest.importorskip("diffusers")

SCALE = 0.8
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("hv15-lora")
    base = tiny.transformer(seed=3)
    base.save_pretrained(root / "transformer")
    targets = sorted(
        name for name, m in base.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d))
    )
    path = lora_tiny.write_peft(base, root / "peft.safetensors", targets, rank=RANK, alpha=ALPHA)
    x = tiny.inputs(3, 4, 6, [5, 2], [0, 2], image=3)
    fwd = load_transformer(root / "transformer", ParallelConfig(tensor=2, ulysses=2))
    return root, path, fwd, x, base, _diffusers(base, path, x), tiny.reference(base, x)


def _diffusers(base, path, x) -> np.ndarray:
    with SafetensorsFile(path) as f:
        sd = {k: torch.from_numpy(f.read(k)) for k in f}
        meta = f.metadata
    model = copy.deepcopy(base)
    peft = json.loads(meta["lora_adapter_metadata"])
    model.load_lora_adapter(sd, prefix=None, metadata=peft, adapter_name="h")
    model.set_adapters(["h"], weights=[SCALE])
    return tiny.reference(model, x)


def _check(case, path, layout: str):
    _, _, fwd, x, _, want, base = case
    assert read_lora(path, fwd.config).layout == layout
    fused = fuse_loras(fwd.params, fwd.config, [(path, SCALE)])
    try:
        got = fwd(**x)
    finally:
        unfuse_loras(fwd.params, fused)
    effect = float(np.abs(want - base).max())
    print(
        f"HunyuanVideo 1.5 {layout}: the LoRA moves the output by {effect:.3f}; {tol.max_error(got, want):.2e} off"
    )
    assert effect > 100 * tol.TORCH_FORWARD.allowed(np.abs(want).max())
    tol.check(got, want, tol.TORCH_FORWARD, f"HunyuanVideo 1.5 LoRA ({layout}) vs diffusers")
    tol.check(fwd(**x), base, tol.TORCH_FORWARD, "HunyuanVideo 1.5 after unfusing vs the base model")


def test_diffusers_peft(case):
    _check(case, case[1], "diffusers")


def test_prefixed_with_alpha_keys(case):
    root, path, *_ = case
    with SafetensorsFile(path) as f:
        t = {k: f.read(k) for k in f}
    out = {f"transformer.{k}": v for k, v in t.items()}
    for k in t:
        if k.endswith(".lora_A.weight"):
            out[f"transformer.{k[: -len('.lora_A.weight')]}.alpha"] = np.float32(ALPHA)
    _check(case, write_safetensors(root / "alpha.safetensors", out), "diffusers")


@pytest.mark.parametrize("layout", list(layouts.LAYOUTS))
def test_layout_matches_diffusers(case, layout):
    root, path, *_ = case
    with SafetensorsFile(path) as f:
        peft = {k: f.read(k) for k in f}
    fused_qkv, key = layouts.LAYOUTS[layout]
    rewritten = layouts.rewrite(peft, ALPHA, fused_qkv=fused_qkv, key=key)
    _check(case, write_safetensors(root / f"{layout}.safetensors", rewritten), layout)


def test_a_lora_for_another_model_size_is_refused(case):
    root, path, fwd, *_ = case
    key = "transformer_blocks.0.attn.to_q.lora_A.weight"
    with SafetensorsFile(path) as f:
        t = {k: f.read(k) for k in f}
    t[key] = np.zeros((RANK, t[key].shape[1] * 2), np.float32)
    bad = write_safetensors(root / "wide.safetensors", t)
    with pytest.raises(LoraError, match="transformer_blocks.0.attn.to_q"):
        read_lora(bad, fwd.config)


def test_pipeline_load_lora_matches_diffusers(tmp_path):
    """``HunyuanVideo15Pipeline.load_lora`` (what ``--lora`` calls) on cfg2 x ulysses2: 3 CFG steps from
    embeddings of the tiny folder, against diffusers' pipeline with the adapter on its transformer."""
    import hunyuan_video15_folder as hf

    from jaxdit.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

    pipe = hf.save(tmp_path / "folder")
    targets = sorted(n for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear))
    path = lora_tiny.write_peft(
        pipe.transformer, tmp_path / "lora.safetensors", targets, rank=RANK, alpha=ALPHA
    )
    emb = {**hf.embeddings([6], [2]), **hf.embeddings([3], [0], seed=1, prefix="negative_")}
    noise = np.random.default_rng(0).standard_normal((1, 4, 2, 2, 3), dtype=np.float32)
    call = dict(height=32, width=48, num_frames=5, num_inference_steps=3)
    args = {k: torch.from_numpy(v) for k, v in emb.items()}
    with torch.no_grad():
        base = pipe(**args, latents=torch.from_numpy(noise), output_type="latent", **call).frames.numpy()
    with SafetensorsFile(path) as f:
        sd, peft = (
            {k: torch.from_numpy(f.read(k)) for k in f},
            json.loads(f.metadata["lora_adapter_metadata"]),
        )
    pipe.transformer.load_lora_adapter(sd, prefix=None, metadata=peft, adapter_name="h")
    pipe.transformer.set_adapters(["h"], weights=[SCALE])
    with torch.no_grad():
        want = pipe(**args, latents=torch.from_numpy(noise), output_type="latent", **call).frames.numpy()
    ours = HunyuanVideo15Pipeline.from_pretrained(tmp_path / "folder", ParallelConfig(cfg=2, ulysses=2))
    ours.load_lora(path, scale=SCALE)
    got = np.asarray(ours(**emb, latents=noise, output_type="latent", progress=False, **call).latents)
    effect = float(np.abs(want - base).max())
    assert effect > 100 * tol.TORCH_LOOP.allowed(np.abs(want).max()), effect
    tol.check(got, want, tol.TORCH_LOOP, "HunyuanVideo 1.5 pipe.load_lora, cfg2 x ulysses2: final latents")
