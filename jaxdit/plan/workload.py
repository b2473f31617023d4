"""What one denoising step computes: a model's shapes, its token counts, its batch and its step count.

A :class:`Workload` is the input of the cost model. It is built from a model preset and an output size
(``Workload.create("flux-dev", height=1024, width=1024)``) or from any ``FluxConfig`` / ``WanConfig``
(the tests use small ones). Token counts follow the pipelines:

- FLUX: latents are [16, H/8, W/8], packed into 2 x 2 patches: (H/16)(W/16) image tokens, joined with
  512 T5 tokens (``max_sequence_length``) in every attention layer.
- Wan 2.1: latents are [16, (F-1)/4 + 1, H/8, W/8], patches 1 x 2 x 2: 720p x 81 frames gives
  21 x 45 x 80 = 75,600 video tokens. Self-attention sees only these; the 512 umT5 tokens (and I2V's 257
  CLIP tokens) enter through cross-attention, which every sequence shard computes locally.

``branches`` is the number of forward passes per denoising step: 2 with classifier-free guidance (Wan
2.1's default, guide_scale 5.0), 1 for FLUX.1-dev, whose guidance is an embedded input (distilled), so
cfg parallelism has nothing to split there (xDiT refuses it for FLUX too).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxdit.models.flux import FluxConfig
from jaxdit.models.wan import TEXT_LEN as WAN_TEXT_LEN
from jaxdit.models.wan import WanConfig

Family = Literal["flux", "wan"]

#: T5 tokens FLUX pipelines pad the prompt to (diffusers' ``max_sequence_length`` default).
FLUX_TEXT_LEN = 512
#: CLIP ViT-H/14 image tokens of Wan 2.1 I2V (penultimate layer, 257 x 1280).
WAN_IMAGE_TOKENS = 257
#: VAE spatial / temporal compression of both families' latents.
VAE_SPATIAL, WAN_VAE_TEMPORAL = 8, 4

#: preset -> (family, default steps, default branches, default (height, width, frames)).
MODELS: dict[str, tuple[Family, int, int, tuple[int, int, int]]] = {
    "flux-dev": ("flux", 28, 1, (1024, 1024, 1)),
    "flux-schnell": ("flux", 4, 1, (1024, 1024, 1)),
    "wan2.1-t2v-1.3b": ("wan", 50, 2, (480, 832, 81)),
    "wan2.1-t2v-14b": ("wan", 50, 2, (720, 1280, 81)),
    "wan2.1-i2v-14b": ("wan", 40, 2, (720, 1280, 81)),
}
#: Short names accepted on the command line.
ALIASES = {"wan-1.3b": "wan2.1-t2v-1.3b", "wan-14b": "wan2.1-t2v-14b", "wan-i2v-14b": "wan2.1-i2v-14b"}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One generation's denoising work, as the cost model needs it.

    ``tokens``: the self-attention token groups (FLUX: (text, image); Wan: (video,)), i.e. what is
    sequence-sharded. ``context``: tokens every shard attends to locally in cross-attention (Wan's text,
    plus I2V's image tokens as a second entry). ``requests``: independent generations in the batch (only
    data parallelism splits them). ``dtype``: the weights' and activations' dtype as served.
    """

    name: str
    family: Family
    model: FluxConfig | WanConfig
    tokens: tuple[int, ...]
    context: tuple[int, ...] = ()
    branches: int = 1
    requests: int = 1
    steps: int = 28
    dtype: str = "bfloat16"
    size: tuple[int, int, int] = (0, 0, 1)  # (height, width, frames), for display

    def __post_init__(self) -> None:
        if self.branches not in (1, 2):
            raise ValueError(f"branches must be 1 (no CFG) or 2 (CFG), got {self.branches}")
        if self.requests < 1 or self.steps < 1 or not self.tokens or min(self.tokens) < 1:
            raise ValueError(
                f"bad workload: tokens={self.tokens}, requests={self.requests}, steps={self.steps}"
            )
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    # ------------------------------------------------------------------ shapes
    @property
    def hidden(self) -> int:
        return self.model.hidden_size if self.family == "flux" else self.model.dim

    @property
    def mlp_hidden(self) -> int:
        return self.model.mlp_hidden if self.family == "flux" else self.model.ffn_dim

    @property
    def num_heads(self) -> int:
        return self.model.num_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def attention_layers(self) -> int:
        """Layers with a sequence-parallel self-attention (FLUX: double + single blocks)."""
        if self.family == "flux":
            return self.model.depth + self.model.depth_single_blocks
        return self.model.num_layers

    @property
    def batch(self) -> int:
        """Samples through the transformer per step: requests x branches."""
        return self.requests * self.branches

    @property
    def sequence(self) -> int:
        return sum(self.tokens)

    @property
    def output_tokens(self) -> int:
        """Tokens whose prediction leaves the model (FLUX: image tokens; Wan: video tokens)."""
        return self.tokens[-1]

    @property
    def output_features(self) -> int:
        return self.model.out_channels if self.family == "flux" else self.model.out_features

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def describe(self) -> str:
        h, w, f = self.size
        frames = f" x {f} frames" if self.family == "wan" else ""
        cfg = "CFG: 2 branches" if self.branches == 2 else "no CFG"
        return (
            f"{self.name} {w}x{h}{frames}: {' + '.join(map(str, self.tokens))} tokens"
            + (f" (+{'+'.join(map(str, self.context))} context)" if self.context else "")
            + f", {cfg}, {self.requests} request(s), {self.steps} steps, {self.dtype}"
        )

    # ----------------------------------------------------------------- builders
    @classmethod
    def create(
        cls,
        model: str,
        *,
        height: int | None = None,
        width: int | None = None,
        frames: int | None = None,
        steps: int | None = None,
        branches: int | None = None,
        requests: int = 1,
        text_tokens: int | None = None,
        dtype: str = "bfloat16",
    ) -> Workload:
        """A preset (``flux-dev``, ``flux-schnell``, ``wan2.1-t2v-1.3b``, ``wan2.1-t2v-14b``,
        ``wan2.1-i2v-14b``) at an output size; unset arguments take the model's defaults."""
        name = ALIASES.get(model, model)
        if name not in MODELS:
            known = ", ".join([*MODELS, *ALIASES])
            raise ValueError(f"unknown model {model!r}; known: {known}")
        family, default_steps, default_branches, (dh, dw, df) = MODELS[name]
        height, width = height or dh, width or dw
        config = FluxConfig.preset(name) if family == "flux" else WanConfig.preset(name)
        return cls.for_config(
            config,
            name=name,
            height=height,
            width=width,
            frames=frames if frames is not None else df,
            steps=steps or default_steps,
            branches=branches or default_branches,
            requests=requests,
            text_tokens=text_tokens,
            dtype=dtype,
        )

    @classmethod
    def for_config(
        cls,
        config: FluxConfig | WanConfig,
        *,
        height: int,
        width: int,
        frames: int = 1,
        name: str = "custom",
        steps: int = 28,
        branches: int | None = None,
        requests: int = 1,
        text_tokens: int | None = None,
        dtype: str = "bfloat16",
    ) -> Workload:
        """Any FLUX or Wan architecture at an output size (pixels; frames for Wan)."""
        factor = 2 * VAE_SPATIAL  # VAE x 2x2 patches
        if height % factor or width % factor or height < factor or width < factor:
            raise ValueError(f"height and width must be positive multiples of {factor}; got {height}x{width}")
        if isinstance(config, FluxConfig):
            if frames != 1:
                raise ValueError(f"FLUX makes images: frames must be 1, got {frames}")
            image = (height // factor) * (width // factor)
            text = FLUX_TEXT_LEN if text_tokens is None else text_tokens
            return cls(
                name=name,
                family="flux",
                model=config,
                tokens=(text, image),
                branches=branches or 1,
                requests=requests,
                steps=steps,
                dtype=dtype,
                size=(height, width, 1),
            )
        if frames < 1 or (frames - 1) % WAN_VAE_TEMPORAL:
            raise ValueError(f"Wan needs 4n + 1 frames (the VAE compresses time 4x), got {frames}")
        pt, ph, pw = config.patch_size
        latent = ((frames - 1) // WAN_VAE_TEMPORAL + 1, height // VAE_SPATIAL, width // VAE_SPATIAL)
        if latent[0] % pt or latent[1] % ph or latent[2] % pw:
            raise ValueError(f"latent {latent} is not a multiple of the patch {config.patch_size}")
        video = math.prod((latent[0] // pt, latent[1] // ph, latent[2] // pw))
        text = WAN_TEXT_LEN if text_tokens is None else text_tokens
        context = (text, WAN_IMAGE_TOKENS) if config.is_i2v else (text,)
        return cls(
            name=name,
            family="wan",
            model=config,
            tokens=(video,),
            context=context,
            branches=branches or 2,
            requests=requests,
            steps=steps,
            dtype=dtype,
            size=(height, width, frames),
        )
