"""A tiny ``Flux2Pipeline`` (FLUX.2 [dev]) folder saved by diffusers: random weights, an offline processor.

- text encoder: ``Mistral3ForConditionalGeneration`` from a tiny transformers config (33 text layers of
  width 32, so diffusers' layers 10, 20 and 30 are all intermediate outputs and jaxdit skips the last two
  on load, as it skips 9 of the 40-layer Mistral Small 3.1; a one-layer Pixtral vision tower the prompt
  path never runs);
- tokenizer: Mistral Small 3.1's processor folder written directly (transformers' ``PixtralProcessor``
  cannot be built without torchvision): a word-level tokenizer trained offline with the ``tokenizers``
  library, with Mistral's control tokens and a post-processor that adds BOS, :data:`CHAT_TEMPLATE` in
  ``chat_template.jinja``, ``processor_config.json`` naming ``PixtralProcessor``, and
  ``model_index.json`` naming it as the tokenizer's class;
- the tiny FLUX.2 transformer of ``flux2_tiny.CONFIG`` with a guidance embedding reading the 3 x 32
  stacked features, klein's tiny VAE (``flux2_klein_tiny.vae``) and FLUX.2's scheduler config.

:func:`text_processor` is what diffusers' reference run gets as ``tokenizer``: a transformers
``ProcessorMixin`` over the folder's tokenizer and template. For prompts without pictures
``PixtralProcessor.apply_chat_template`` is ``ProcessorMixin``'s (render, the BOS rule, the tokenizer), so
the reference tokenizes through transformers' own processor code.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

ENCODER_LAYERS, ENCODER_WIDTH = 33, 32
VOCAB = 128
CONTROL = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
#: A Mistral-style template: BOS, the system turn in [SYSTEM_PROMPT] markers, user turns in [INST] ones
#: (text parts joined, pictures as [IMG]), assistant turns closed by EOS.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set parts = message['content'] if message['content'] is not string "
    "else [{'type': 'text', 'text': message['content']}] %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- endif %}"
    "{%- for part in parts %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if message['role'] == 'system' %}{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[/INST]' }}"
    "{%- else %}{{- eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def mistral3(seed: int = 4):
    """The tiny Mistral3 text encoder (Mistral text decoder, one key/value head, a one-layer Pixtral tower)."""
    import decoder_lm_tiny
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(
        decoder_lm_tiny.TEXT,
        vocab_size=VOCAB,
        num_hidden_layers=ENCODER_LAYERS,
        num_key_value_heads=1,
        head_dim=8,
    )
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  patch_size=4, image_size=16, head_dim=8)  # fmt: skip
    config = Mistral3Config(text_config={"model_type": "mistral", **text}, vision_config=vision)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return decoder_lm_tiny._perturb(Mistral3ForConditionalGeneration(config), seed).eval()


def save_processor(folder) -> Path:
    """Mistral Small 3.1's processor folder, written without transformers' processor class."""
    import decoder_lm_tiny
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    words = [SYSTEM_MESSAGE, " ".join([*decoder_lm_tiny.PROMPT_WORDS, "of"])]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=CONTROL + IMAGE_TOKENS))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in CONTROL + IMAGE_TOKENS])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="right",
    )
    assert len(hf) <= VOCAB, len(hf)
    hf.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    processor = dict(
        processor_class="PixtralProcessor",
        patch_size=4,
        spatial_merge_size=1,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    image = dict(image_processor_type="PixtralImageProcessor", patch_size={"height": 4, "width": 4},
                 size={"longest_edge": 64}, do_resize=True, do_rescale=True, do_normalize=True)  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    return folder


def pipeline(folder) -> Path:
    """Save the tiny dev folder at ``folder``; returns the path."""
    import flux2_klein_tiny
    import flux2_tiny
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    staging = Path(tempfile.mkdtemp(prefix="jaxdit-flux2dev-staging-"))
    try:
        mistral3().save_pretrained(staging / "text_encoder")
        from transformers import Mistral3ForConditionalGeneration

        pipe = Flux2Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential"
            ),
            vae=flux2_klein_tiny.vae(),
            text_encoder=Mistral3ForConditionalGeneration.from_pretrained(staging / "text_encoder").eval(),
            tokenizer=None,
            transformer=flux2_tiny.transformer(seed=65, joint_attention_dim=3 * ENCODER_WIDTH),
        )
        pipe.save_pretrained(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    folder = Path(folder)
    save_processor(folder / "tokenizer")
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def text_processor(folder):
    """The folder's processor for prompts without pictures: transformers' ``ProcessorMixin`` over its
    tokenizer, with the template it saved."""
    from transformers import AutoTokenizer, ProcessorMixin

    class TextProcessor(ProcessorMixin):
        attributes = ["tokenizer"]
        tokenizer_class = "AutoTokenizer"

    tokenizer_dir = Path(folder) / "tokenizer"
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    return TextProcessor(AutoTokenizer.from_pretrained(tokenizer_dir), chat_template=template)
