"""Recognising downloaded model folders, and the errors for folders that cannot work (before any read)."""

import json

import pytest

from jaxdit.families import open_folder
from jaxdit.pipelines import wan as wan_pipeline


def open_model_folder(path):
    return open_folder(path)[1]


FLUX_COMPONENTS = (
    "transformer",
    "vae",
    "text_encoder",
    "text_encoder_2",
    "tokenizer",
    "tokenizer_2",
    "scheduler",
)


# The model classes a pipeline's transformer and VAE must be (other components are not checked).
_MODEL_CLASSES = {
    "FluxPipeline": {"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL"},
    "WanPipeline": {
        "transformer": "WanTransformer3DModel",
        "transformer_2": "WanTransformer3DModel",
        "vae": "AutoencoderKLWan",
    },
    "WanImageToVideoPipeline": {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan"},
}


def _diffusers_folder(root, class_name, components, skip=(), extra=None):
    classes = _MODEL_CLASSES.get(class_name, {})
    index = {
        "_class_name": class_name,
        **{c: ["x", classes.get(c, "y")] for c in components},
        **(extra or {}),
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps(index))
    for c in components:
        if c not in skip:
            (root / c).mkdir()
    if "scheduler" not in skip:
        (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": 3.0}))
    return root


def test_flux_diffusers_folder_names_every_component(tmp_path):
    folder = open_model_folder(_diffusers_folder(tmp_path / "flux", "FluxPipeline", FLUX_COMPONENTS))
    assert (folder.kind, folder.layout) == ("flux", "diffusers")
    assert folder["vae"] == tmp_path / "flux" / "vae"
    assert folder.scheduler_config == {"shift": 3.0}
    assert folder.family != "wan"


def test_missing_components_are_all_listed(tmp_path):
    root = _diffusers_folder(tmp_path / "flux", "FluxPipeline", FLUX_COMPONENTS, skip=("vae", "tokenizer_2"))
    with pytest.raises(ValueError, match=r"missing: vae/, tokenizer_2/"):
        open_model_folder(root)


def test_unsupported_pipeline_class_is_named(tmp_path):
    root = _diffusers_folder(tmp_path / "sd", "StableDiffusionPipeline", ("unet", "vae", "scheduler"))
    with pytest.raises(
        ValueError,
        # The list grows with the registry: the refused class is named, then the classes jaxdit runs.
        match=r"'StableDiffusionPipeline'; jaxdit runs [\w, ]*\bFluxPipeline\b[\w, ]*\bWanPipeline\b",
    ):
        open_model_folder(root)


def test_wan22_two_transformer_folder(tmp_path):
    # Wan 2.2 A14B: transformer_2 and boundary_ratio (tests/test_wan22_folders.py has the other cases).
    components = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler")
    root = _diffusers_folder(tmp_path / "wan", "WanPipeline", components, extra={"boundary_ratio": 0.875})
    folder = open_model_folder(root)
    assert folder.kind == "wan2.2-t2v" and folder["transformer_2"] == root / "transformer_2"


def test_wan_i2v_diffusers_folder(tmp_path):
    components = (
        "transformer",
        "vae",
        "text_encoder",
        "tokenizer",
        "scheduler",
        "image_encoder",
        "image_processor",
    )
    folder = open_model_folder(_diffusers_folder(tmp_path / "i2v", "WanImageToVideoPipeline", components))
    assert folder.kind == "wan-i2v" and folder.family == "wan"


def _wan_original(root, skip=()):
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "t2v", "dim": 1536}))
    for name in (wan_pipeline.ORIGINAL_VAE, wan_pipeline.ORIGINAL_T5):
        if name not in skip:
            (root / name).write_bytes(b"")
    if wan_pipeline.ORIGINAL_TOKENIZER not in skip:
        (root / wan_pipeline.ORIGINAL_TOKENIZER).mkdir(parents=True)
    return root


def test_wan_original_release_folder(tmp_path):
    folder = open_model_folder(_wan_original(tmp_path / "Wan2.1-T2V-1.3B"))
    assert (folder.kind, folder.layout) == ("wan-t2v", "wan-original")
    assert folder["vae"].name == wan_pipeline.ORIGINAL_VAE and folder.scheduler_config is None


def test_wan_original_folder_missing_the_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="missing: google/umt5-xxl"):
        open_model_folder(_wan_original(tmp_path / "w", skip=(wan_pipeline.ORIGINAL_TOKENIZER,)))


def test_wan_original_i2v_release_points_to_the_diffusers_folder(tmp_path):
    root = _wan_original(tmp_path / "w")
    (root / wan_pipeline.ORIGINAL_CLIP).write_bytes(b"")
    with pytest.raises(ValueError, match="open-clip layout"):
        open_model_folder(root)


def test_a_transformer_folder_alone_is_not_a_pipeline(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no pipeline"):
        open_model_folder(tmp_path)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        open_model_folder(tmp_path / "nothing")


def test_missing_scheduler_config_is_named(tmp_path):
    root = _diffusers_folder(tmp_path / "flux", "FluxPipeline", FLUX_COMPONENTS)
    (root / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(ValueError, match=r"scheduler_config.json: cannot read it"):
        open_model_folder(root)


def test_wan_original_folder_without_config_json(tmp_path):
    root = _wan_original(tmp_path / "w")
    (root / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config.json: cannot read it"):
        open_model_folder(root)
