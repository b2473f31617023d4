"""A tiny random diffusers ``ZImageTransformer2DModel`` and inputs for it.

Four heads of 16 (so ulysses2 x tensor2 splits them), one refiner block per stream and two joint blocks,
RoPE axes (4, 6, 6); every weight perturbed away from its initial value (norm scales not all ones, the
pad tokens and zero-initialised layers non-zero).
"""

from __future__ import annotations

import numpy as np
import torch

CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=64,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=4,
    n_kv_heads=4,
    cap_feat_dim=24,
    axes_dims=[4, 6, 6],
    axes_lens=[160, 16, 16],
)


def transformer(seed: int = 0, scale: float = 0.1, **overrides) -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(**{**CONFIG, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def inputs(lengths, rows: int, cols: int, seed: int = 0):
    """(latents [B, C, 2 rows, 2 cols], one [L_i, 24] caption array per sample, timesteps [B] in (0, 1))."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((len(lengths), CONFIG["in_channels"], 2 * rows, 2 * cols)).astype(
        np.float32
    )
    caps = [rng.standard_normal((n, CONFIG["cap_feat_dim"])).astype(np.float32) for n in lengths]
    return latents, caps, rng.uniform(0.05, 1.0, len(lengths)).astype(np.float32)


def reference(model: torch.nn.Module, latents, caps, t) -> np.ndarray:
    """diffusers' prediction [B, C, H, W] (its own sign; the pipeline negates it)."""
    with torch.no_grad():
        out = model(
            [torch.from_numpy(x)[:, None] for x in latents],
            torch.from_numpy(t),
            [torch.from_numpy(c) for c in caps],
            return_dict=False,
        )[0]
    return np.stack([o[:, 0].numpy() for o in out])


# --------------------------------------------------------------------------------------------------------
# A tiny ZImagePipeline folder
# --------------------------------------------------------------------------------------------------------

#: A Qwen3-style chat template for one user turn: the generation prompt, and the empty think block only
#: when thinking is switched off (what Qwen3's own template does for these two cases).
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{%- endif %}{%- endif %}"
)


def save_tokenizer(folder) -> None:
    """The tiny word-level Qwen tokenizer (tests/decoder_lm_tiny.py) with :data:`CHAT_TEMPLATE`."""
    import decoder_lm_tiny
    from transformers import AutoTokenizer

    decoder_lm_tiny.save_qwen_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def pipeline(folder, *, turbo: bool = True):
    """Save a tiny ``ZImagePipeline`` (random weights, offline tokenizer) at ``folder``; returns it.

    Qwen3 text encoder of 3 layers and width 32 (the features are its layer-2 output); the transformer of
    :data:`CONFIG` reading width 32; a 2-level FLUX-style AutoencoderKL (factor 2, 4 latent channels) with
    FLUX's scaling and shift; the Turbo scheduler config (shift 3, no dynamic shifting)."""
    import tempfile
    from pathlib import Path

    import decoder_lm_tiny
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import AutoTokenizer, Qwen3Model

    staging = Path(tempfile.mkdtemp(prefix="jaxdit-zimage-staging-"))
    save_tokenizer(staging / "tokenizer")
    decoder_lm_tiny.decoder(decoder_lm_tiny.qwen3()).save_pretrained(staging / "text_encoder")
    text_encoder = Qwen3Model.from_pretrained(staging / "text_encoder").eval()
    torch.manual_seed(51)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    gen = torch.Generator().manual_seed(52)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
    )
    pipe = ZImagePipeline(
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=text_encoder,
        tokenizer=AutoTokenizer.from_pretrained(staging / "tokenizer"),
        transformer=transformer(seed=53, cap_feat_dim=32),
    )
    pipe.save_pretrained(folder)
    return pipe
