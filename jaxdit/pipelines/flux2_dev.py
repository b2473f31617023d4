"""FLUX.2 [dev] on a mesh: diffusers' ``Flux2Pipeline`` call (``pipelines/flux2/pipeline_flux2.py``),
text-to-image and multi-reference editing.

What differs from klein (``pipelines/flux2.py``, whose latents, schedule, references and decoding it
shares):

- conditioning: Mistral Small 3.1's stacked hidden states (layers 10, 20, 30) of the prompt written as
  a system turn (:data:`~jaxdit.text_encoders.flux2_dev_prompt.SYSTEM_MESSAGE`) and a user turn by the
  folder's processor chat template (``text_encoders/flux2_dev_prompt.py``);
- guidance: dev is guidance-distilled. ``guidance_scale`` (default 4) is an input of the transformer's
  guidance embedding, the same for every batch row; every step runs ONE forward pass, so there is no
  negative prompt, no true CFG and nothing for ``--use_cfg_parallel`` to split;
- the schedule is klein's: ``linspace(1, 1/N, N)`` shifted by the folder scheduler's rule with
  ``compute_empirical_mu`` of the image tokens and the step count.

``output_type="latent"`` returns the de-normalised, un-patchified VAE latents [B, 32, H/8, W/8]: what
diffusers' ``Flux2Pipeline`` hands its VAE (its own ``"latent"`` output is the normalised packed tokens
before that step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit.pipelines.base import GenerationOutput, Prepared
from jaxdit.pipelines.flux2 import Flux2KleinPipeline
from jaxdit.pipelines.model_folder import FolderClass
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.flux2_dev_prompt import Flux2DevPromptEncoder, processor_chat_template
from jaxdit.text_encoders.flux2_prompt import DEV_HIDDEN_STATES, MAX_SEQUENCE_LENGTH

__all__ = ["DISTILLED", "FOLDER_CLASSES", "Flux2Pipeline"]

FOLDER_CLASSES = {
    "Flux2Pipeline": FolderClass(
        "flux2-dev",
        "flux2-dev",
        ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        classes={"transformer": ("Flux2Transformer2DModel",), "vae": ("AutoencoderKLFlux2",)},
    )
}

#: What a request for a second guidance branch is told.
DISTILLED = (
    "FLUX.2 [dev] is guidance-distilled: it runs one branch per step with --guidance_scale as an input "
    "of its guidance embedding, so it takes no negative prompt, no --true_cfg_scale and no "
    "--use_cfg_parallel"
)


class Flux2Pipeline(Flux2KleinPipeline):
    """A FLUX.2 [dev] transformer (with a guidance embedding) on a mesh plus the Euler sampler, optional
    prompt encoder (Mistral3), VAE encoder (references) and decoder; built like klein's
    (``from_pretrained`` of a diffusers ``Flux2Pipeline`` folder)."""

    cfg_hint = DISTILLED
    # Its PipeFusion caches (klein's pipefusion_caches): a skipped step reads the embedded guidance in its
    # conditioning (tests/test_flux2_dev_pipefusion.py).
    folder_classes = FOLDER_CLASSES
    embeds_guidance = True
    hidden_states = DEV_HIDDEN_STATES
    wrong_transformer = (
        "this FLUX.2 transformer has no guidance embedding (FLUX.2 [klein]): run it with "
        "Flux2KleinPipeline; Flux2Pipeline runs FLUX.2 [dev] (guidance_embeds=True)"
    )

    def __init__(self, model: Any, mesh: Any, **options: Any) -> None:
        options["is_distilled"] = True  # one branch whatever the scale: the scale is embedded
        super().__init__(model, mesh, **options)

    @classmethod
    def prompt_encoder(cls, tokenizer: Path, runner: DecoderLMRunner) -> Callable[..., np.ndarray]:
        """Mistral Small 3.1's processor folder: its tokenizer and the processor's chat template."""
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(tokenizer)
        template = processor_chat_template(tokenizer, loaded)
        return Flux2DevPromptEncoder(loaded, runner, template, cls.hidden_states)

    @classmethod
    def one_branch(cls, index: dict) -> bool:
        return True

    def __call__(
        self,
        image: Any = None,
        prompt: str | Sequence[str] | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: Sequence[float] | None = None,
        guidance_scale: float = 4.0,
        num_images_per_prompt: int = 1,
        seed: int = 0,
        latents: np.ndarray | None = None,
        prompt_embeds: np.ndarray | None = None,
        output_type: str = "np",
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        cache: Any = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
    ) -> GenerationOutput:
        """Generate (or, with ``image``: one picture or a list, edit) as diffusers' ``Flux2Pipeline``.
        ``guidance_scale`` feeds the guidance embedding (one branch per step); ``latents``: initial noise
        [B, 128, H/16, W/16] instead of the seed's; ``prompt_embeds`` [B, L, joint_attention_dim];
        height / width default to the first reference picture's size, else 1024. PipeFusion (a mesh with
        pipefusion > 1): ``num_pipeline_patch``, ``warmup_steps``."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    def prepare(self, r: GenerationRequest) -> Prepared:
        if r.negative_prompt is not None or r.negative_prompt_embeds is not None:
            raise ValueError(DISTILLED)
        prepared = super().prepare(r)  # one branch: klein's distilled path
        batch = len(prepared.inputs.tokens)
        prepared.inputs.context["guidance"] = np.full((batch,), r.guidance_scale, np.float32)
        return prepared
