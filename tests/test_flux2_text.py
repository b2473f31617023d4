"""FLUX.2's text features against transformers, per encoder: stacked hidden states of a batch padded on
the right and on the left, every token kept (padding included, as the FLUX.2 pipelines keep it).

- klein: Qwen3 layers 9, 18, 27 (the whole prompt path, tokenizer and chat template included, is the
  CLI test's, ``tests/test_flux2_cli.py``);
- dev: Mistral Small 3.1's text decoder inside ``Mistral3ForConditionalGeneration``, layers 10, 20, 30,
  from token ids, the encoder read without its last two (of 33) layers (the processor, system message and template are the dev CLI test's,
  ``tests/test_flux2_dev_cli.py``).
"""

from __future__ import annotations

import decoder_lm_tiny
import numpy as np
import pytest
import tolerance as tol

from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.flux2_prompt import DEV_HIDDEN_STATES, HIDDEN_STATES, stacked_features

torch = pytest.importorskip("torch")


def _mistral3(layers: int):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(decoder_lm_tiny.TEXT, num_hidden_layers=layers, num_key_value_heads=1, head_dim=8)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  patch_size=4, image_size=16, head_dim=8)  # fmt: skip
    config = Mistral3Config(text_config={"model_type": "mistral", **text}, vision_config=vision)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(4)
    return decoder_lm_tiny._perturb(Mistral3ForConditionalGeneration(config), 4)


def _ids_and_mask():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, decoder_lm_tiny.TEXT["vocab_size"], (3, 12))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # padded on the right, as padding="max_length" pads with padding_side="right"
    mask[2, :4] = 0  # and on the left (a tokenizer with padding_side="left": the padding's rows see no key)
    return ids, mask


@pytest.mark.parametrize(
    "name, build, layers",
    [
        ("klein", lambda: decoder_lm_tiny.qwen3(num_hidden_layers=28), HIDDEN_STATES),
        ("dev", lambda: _mistral3(33), DEV_HIDDEN_STATES),
    ],
    ids=["klein-qwen3", "dev-mistral3"],
)
def test_stacked_features_match_transformers(tmp_path, name, build, layers):
    model = build()
    model.save_pretrained(tmp_path / "text_encoder")
    ids, mask = _ids_and_mask()
    # Read as the pipelines read it: only the layers up to the deepest stacked one, plus one.
    keep = max(layers) + 1
    lm = load_decoder_lm(tmp_path / "text_encoder", layers=keep)
    assert lm.config.num_hidden_layers == min(keep, model.config.get_text_config().num_hidden_layers)
    got = stacked_features(DecoderLMRunner(lm), ids, mask, layers)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            output_hidden_states=True,
            use_cache=False,
        )
    want = torch.stack([out.hidden_states[k] for k in layers], dim=1)
    b, n, length, e = want.shape
    want = want.permute(0, 2, 1, 3).reshape(b, length, n * e).numpy()
    assert got.shape == want.shape == (3, 12, 3 * decoder_lm_tiny.TEXT["hidden_size"])
    tol.check(got, want, tol.TORCH_FORWARD, f"FLUX.2 {name} stacked text features vs transformers")
