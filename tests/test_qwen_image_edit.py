"""Qwen-Image-Edit-2509 (diffusers' ``QwenImageEditPlusPipeline``) and the original Qwen-Image-Edit
(``QwenImageEditPipeline``) end to end: tiny random folders saved by diffusers (the same components), an
instruction and two pictures of different aspect ratios (Edit-2509) or one (Edit), true CFG 4.0, through
``jaxdit generate --image A [--image B]`` on cfg2 x ulysses2 and on ulysses2 x ring2 (4 emulated devices),
against diffusers running the reloaded folder with the same initial noise (computed once per folder);
and the prompt embeddings (Qwen2.5-VL with its vision tower and the edit templates) against diffusers'
``encode_prompt``.

Two things the tiny setup changes, on both sides alike:

- ``Qwen2VLProcessor`` needs torchvision (for its video half), which this venv lacks: diffusers gets a
  stand-in that does what the processor does (the folder's ``Qwen2VLImageProcessorPil`` and tokenizer,
  each image-pad marker repeated once per merged patch) and returns ``mm_token_type_ids``;
- diffusers 0.42 drops ``mm_token_type_ids`` before calling the text encoder, so on transformers 5 its
  Qwen2.5-VL silently falls back to 1-D positions (huggingface/diffusers issue 14194, PR 14189): the
  reference's text encoder is given them again (the 3-axis positions the model was trained with and
  transformers 4 computed from the ids). ``test_qwen_vl_encoder.py`` shows the fallback is far off.
- the VAE pictures' area (``VAE_IMAGE_SIZE`` in the Plus pipeline, a literal 1024^2 in the Edit one) is
  set to 64^2 in both sides' pipelines: the tiny VAE's factor 2 would make 1024^2 pictures 65536 tokens.

Bounds: the project's (latents 1e-4 relative, PNG 1.5/255; prompt embeddings 1e-5), errors printed
(``pytest -s``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import qwen_image_edit_folder as edit_folder  # noqa: E402
import qwen_image_tiny  # noqa: E402
import torch  # noqa: E402

from jaxdit import cli, generate  # noqa: E402
from jaxdit.pipelines import latents as latent_ops  # noqa: E402
from jaxdit.pipelines import qwen_image_edit  # noqa: E402

PROMPT, NEGATIVE = "a red car at sunset", "a big dog"
H, W, STEPS, SEED, CFG = 32, 40, 2, 5, 4.0
LATENT_REL, PNG_STEPS, EMBED_REL = 1e-4, 1.5, 1e-5
FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    import diffusers

    patch = pytest.MonkeyPatch()
    edit_folder.patch_areas(patch)
    saved = edit_folder.save(tmp_path_factory.mktemp("qwen_image_edit"))
    folders, reloaded = saved["folders"], saved["reloaded"]
    ref = reloaded(diffusers.QwenImageEditPlusPipeline, folders["plus"])
    yield dict(
        folder=folders["plus"],
        folders=folders,
        paths=saved["paths"],
        ref=ref,
        reloaded={
            "plus": lambda: ref,
            "edit": lambda: reloaded(diffusers.QwenImageEditPipeline, folders["edit"]),
        },
    )
    patch.undo()


# the pictures each pipeline is given: Edit-2509 two of different aspect ratios, the original Edit one
PICTURES = {"plus": [0, 1], "edit": [1]}


@pytest.fixture(scope="module")
def references(case):
    """Diffusers' final latents and picture from each reloaded folder, computed once for both meshes."""
    done = {}

    def of(kind):
        if kind not in done:
            ref = case["reloaded"][kind]()
            pictures = [Image.open(case["paths"][k]).convert("RGB") for k in PICTURES[kind]]
            noise = latent_ops.initial_noise(SEED, (1, 4, H // 2, W // 2))
            call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=CFG, height=H, width=W)
            final = []

            def keep(pipe, step, t, tensors):  # the latents after each step; the last one is decoded
                final.append(tensors["latents"].clone())
                return tensors

            with torch.no_grad():
                out = ref(
                    pictures if kind == "plus" else pictures[0],
                    **call,
                    num_inference_steps=STEPS,
                    latents=torch.from_numpy(latent_ops.pack(noise)),
                    output_type="np",
                    callback_on_step_end=keep,
                )
            done[kind] = (
                latent_ops.unpack(final[-1].numpy(), H // 2, W // 2),
                np.asarray(out.images[0], np.float32),
            )
        return done[kind]

    return of


def test_prompt_embeddings_match_diffusers(case):
    """Two pictures through the vision tower into the Plus template, 64 tokens dropped, as diffusers."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        calculate_dimensions,
    )

    ref = case["ref"]
    pictures = [Image.open(p).convert("RGB") for p in case["paths"]]
    condition = []
    for p in pictures:
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, p.width / p.height)
        condition.append(ref.image_processor.resize(p, h, w))
    with torch.no_grad():
        want, want_mask = ref.encode_prompt(PROMPT, image=condition)
    encoder = qwen_image_edit.load_edit_prompt_encoder(case["folder"], plus=True)
    pipe_like = qwen_image_edit.QwenImageEditPipeline.__new__(qwen_image_edit.QwenImageEditPipeline)
    pipe_like.plus = True
    mine = pipe_like.condition_pictures(pictures)
    assert [m.size for m in mine] == [c.size for c in condition]
    got, mask = encoder([PROMPT], images=mine)
    want = want.numpy()
    assert want_mask is None and mask.all() and got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"edit prompt embeddings (two pictures): {err:.2e} relative")
    assert err < EMBED_REL


MESHES = {
    "cfg2 x ulysses2": ["--use_cfg_parallel", "--ulysses_degree", "2"],
    "ulysses2 x ring2": ["--ulysses_degree", "2", "--ring_degree", "2"],
}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("kind", ["plus", "edit"])
def test_cli_matches_diffusers(case, references, kind, mesh, tmp_path, monkeypatch):
    """``jaxdit generate`` on 4 devices from the Edit-2509 folder (two pictures) and the original Edit's
    (one picture), against diffusers from the same reloaded folder."""
    results = []

    def write(r, result):
        results.append(np.asarray(result.latents))
        return written(r, result)

    written = generate.write
    monkeypatch.setattr(generate, "write", write)
    loads = qwen_image_edit.QwenImageEditPipeline.from_pretrained.__func__

    def quick(cls, *args, **kwargs):  # XLA's backend optimisations off: compiles in a fraction of the time
        return loads(cls, *args, **{**kwargs, "compiler_options": FAST})

    monkeypatch.setattr(qwen_image_edit.QwenImageEditPipeline, "from_pretrained", classmethod(quick))
    argv = ["generate", "--weights", str(case["folders"][kind]), "--prompt", PROMPT]
    argv += ["--negative_prompt", NEGATIVE]
    for k in PICTURES[kind]:
        argv += ["--image", str(case["paths"][k])]
    argv += ["--true_cfg_scale", str(CFG), "--height", str(H), "--width", str(W), "--steps", str(STEPS)]
    argv += ["--seed", str(SEED), *MESHES[mesh]]
    assert cli.main([*argv, "--output", str(tmp_path / "edited.png")]) == 0
    (latents,) = results
    png = np.asarray(Image.open(tmp_path / "edited.png"), np.float32)
    want, want_png = references(kind)
    rel = np.linalg.norm(latents - want) / np.linalg.norm(want)
    worst = np.abs(png - want_png * 255).max()
    label = {"plus": "Edit-2509, two pictures", "edit": "Edit, one picture"}[kind]
    print(f"{label}, {mesh}: latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert latents.shape == want.shape and rel < LATENT_REL, rel
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst


def _diffusers_forward(model, x, refs, grids):
    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(np.concatenate([x["hidden_states"], refs], axis=1)),
            encoder_hidden_states=torch.from_numpy(x["encoder_hidden_states"]),
            encoder_hidden_states_mask=torch.from_numpy(x["encoder_hidden_states_mask"]),
            timestep=torch.from_numpy(x["timestep"]),
            img_shapes=[[(1, r, c) for r, c in grids]] * 2,
            return_dict=False,
        )[0]
    return out[:, : x["hidden_states"].shape[1]].numpy()


def test_edit_2511_transformer_with_references_matches_diffusers(tmp_path):
    """Edit-2511's transformer (``zero_cond_t``: the reference tokens' modulation from timestep 0) with
    two reference pictures joined to the noise (RoPE frames 1 and 2, each grid centred on its own, the
    text past the largest), on ulysses2 x ring2 (three token groups padded), against diffusers' forward
    on ``img_shapes``; the same weights without ``zero_cond_t`` predict far from it (the 2509 path is the
    CLI test's)."""
    from jaxdit import ParallelConfig, families
    from jaxdit.models.qwen_image_config import edit_rope_positions

    model = qwen_image_tiny.transformer(zero_cond_t=True)
    model.save_pretrained(tmp_path / "transformer")
    grids = [(3, 5), (4, 4), (2, 3)]  # the denoised image, then two pictures (packed tokens)
    x = qwen_image_tiny.inputs(2, 7, 3, 5, [7, 4])
    refs = np.random.default_rng(3).standard_normal((2, 16 + 6, 16)).astype(np.float32)
    want = _diffusers_forward(model, x, refs, grids)
    plain = _diffusers_forward(qwen_image_tiny.transformer(), x, refs, grids)
    txt_ids, img_ids, ref_ids = edit_rope_positions(7, grids)
    forward = families.load_transformer(tmp_path / "transformer", ParallelConfig(ulysses=2, ring=2))
    got = np.asarray(
        forward(**x, txt_ids=txt_ids, img_ids=img_ids, reference_hidden_states=refs, reference_ids=ref_ids)
    )
    err = np.abs(got - want).max() / np.abs(want).max()
    off = np.abs(plain - want).max() / np.abs(want).max()
    print(f"Edit-2511 transformer with references: {err:.2e} relative (without zero_cond_t: {off:.2e})")
    assert err < EMBED_REL and off > 1e3 * EMBED_REL


def test_edit_prompt_with_one_picture_matches_diffusers(case):
    """Qwen-Image-Edit's own template (one slot before the instruction; the picture at the VAE size) as
    diffusers' ``QwenImageEditPipeline.encode_prompt``, the same folder's components."""
    import diffusers

    ref = case["ref"]
    edit = diffusers.QwenImageEditPipeline(
        scheduler=ref.scheduler,
        vae=ref.vae,
        text_encoder=ref.text_encoder,
        tokenizer=ref.tokenizer,
        processor=None,
        transformer=ref.transformer,
    )
    object.__setattr__(edit, "processor", ref.processor)
    picture = Image.open(case["paths"][1]).convert("RGB")
    pipe_like = qwen_image_edit.QwenImageEditPipeline.__new__(qwen_image_edit.QwenImageEditPipeline)
    pipe_like.plus = False
    (condition,) = pipe_like.condition_pictures([picture])
    with torch.no_grad():
        want, _ = edit.encode_prompt(PROMPT, image=condition)
    got, mask = qwen_image_edit.load_edit_prompt_encoder(case["folder"], plus=False)(
        [PROMPT], images=[condition]
    )
    want = want.numpy()
    assert mask.all() and got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"Qwen-Image-Edit prompt embeddings (one picture): {err:.2e} relative")
    assert err < EMBED_REL


# ------------------------------------------------------------------ refused, before any weight loads


def _refused(argv, tmp_path, capsys, message):
    out = tmp_path / "never.png"
    assert cli.main([*argv, "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_unsupported_runs_are_refused(case, tmp_path, capsys):
    import shutil

    base = ["generate", "--weights", str(case["folder"]), "--prompt", PROMPT, "--steps", "2"]
    base += ["--height", str(H), "--width", str(W)]
    picture = ["--image", str(case["paths"][0])]
    _refused(base, tmp_path, capsys, "Qwen-Image-Edit edits a picture: pass --image IN.png")
    layered = shutil.copytree(case["folder"], tmp_path / "layered")
    config = layered / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_layer3d_rope": True}))
    _refused(
        ["generate", "--weights", str(layered), *base[3:], *picture], tmp_path, capsys, "use_layer3d_rope"
    )
