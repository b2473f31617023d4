"""Reliability: a pipeline folder whose transformer or VAE is another family's class is refused when the
folder is opened (before anything is read), whatever ``model_index.json`` or the component's
``config.json`` says; the message names the component, the class found and the class expected.
"""

from __future__ import annotations

import json

import pytest

from jaxdit.families import open_folder
from jaxdit.pipelines import model_folder as mf

FLUX = (
    "FluxPipeline",
    ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
)
WAN = ("WanPipeline", ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"))
WAN_I2V = (
    "WanImageToVideoPipeline",
    ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "image_encoder", "image_processor"),
)
RIGHT = {
    "FluxPipeline": {"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL"},
    "WanPipeline": {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan"},
    "WanImageToVideoPipeline": {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan"},
}


def _folder(root, pipeline, *, index=None, config=None):
    """A pipeline folder as save_pretrained lays it out (no weights: the check reads only JSON).

    ``index`` / ``config`` override a component's class in model_index.json / its config.json."""
    name, components = pipeline
    classes = {**RIGHT[name]}
    entries = {c: ["diffusers", classes.get(c, "Other")] for c in components}
    entries.update({c: ["diffusers", cls] for c, cls in (index or {}).items()})
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": name, **entries}))
    for c in components:
        (root / c).mkdir()
        if c in classes:
            cls = (config or {}).get(c, classes[c])
            (root / c / "config.json").write_text(json.dumps({"_class_name": cls}))
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    return root


# (name, pipeline, model_index overrides, config.json overrides, what the message must name)
CASES = [
    (
        "flux-with-sd3-transformer-config",
        FLUX,
        {},
        {"transformer": "SD3Transformer2DModel"},
        "transformer/config.json is a 'SD3Transformer2DModel'",
    ),
    (
        "flux-with-sd3-transformer-index",
        FLUX,
        {"transformer": "SD3Transformer2DModel"},
        {},
        "names transformer 'SD3Transformer2DModel'",
    ),
    (
        "flux-with-wan-vae",
        FLUX,
        {"vae": "AutoencoderKLWan"},
        {"vae": "AutoencoderKLWan"},
        "'AutoencoderKLWan'",
    ),
    (
        "wan-with-flux-transformer",
        WAN,
        {},
        {"transformer": "FluxTransformer2DModel"},
        "'FluxTransformer2DModel'",
    ),
    ("wan-with-image-vae", WAN, {}, {"vae": "AutoencoderKL"}, "vae/config.json is a 'AutoencoderKL'"),
    (
        "wan-i2v-with-sd3-transformer",
        WAN_I2V,
        {"transformer": "SD3Transformer2DModel"},
        {},
        "'SD3Transformer2DModel'",
    ),
    (
        "wan-with-wan22-transformer-class",
        WAN,
        {},
        {"transformer": "WanAnimateTransformer3DModel"},
        "'WanAnimateTransformer3DModel'",
    ),
]


@pytest.mark.parametrize(("name", "pipeline", "index", "config", "names"), CASES, ids=[c[0] for c in CASES])
def test_wrong_component_class_is_refused(name, pipeline, index, config, names, tmp_path):
    root = _folder(tmp_path / "model", pipeline, index=index, config=config)
    with pytest.raises(ValueError, match="needs transformer") as info:
        open_folder(root)
    message = str(info.value)
    assert names in message and str(root) in message and len(message.splitlines()) == 1, message


@pytest.mark.parametrize("pipeline", [FLUX, WAN, WAN_I2V], ids=lambda p: p[0])
def test_right_classes_open(pipeline, tmp_path):
    assert open_folder(_folder(tmp_path / "model", pipeline))[1].root == tmp_path / "model"


def test_generate_refuses_the_folder_before_jax_starts(tmp_path, capsys):
    from jaxdit.cli import main

    root = _folder(tmp_path / "model", FLUX, config={"transformer": "SD3Transformer2DModel"})
    code = main(
        ["generate", "--weights", str(root), "--prompt", "a cat", "--output", str(tmp_path / "cat.png")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "'SD3Transformer2DModel'" in err and "FluxTransformer2DModel" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no picture, nothing else


def test_check_is_a_function_of_the_expected_classes(tmp_path):
    # Families pass their own table: a component they do not list is not checked.
    root = _folder(tmp_path / "model", FLUX, config={"vae": "SomethingElse"})
    index = json.loads((root / "model_index.json").read_text())
    mf.check_component_classes(root, index, {"transformer": ("FluxTransformer2DModel",)})
    with pytest.raises(ValueError, match="vae/config.json is a 'SomethingElse'.*vae: AutoencoderKL or Mine"):
        mf.check_component_classes(root, index, {"vae": ("AutoencoderKL", "Mine")}, "FluxPipeline")
