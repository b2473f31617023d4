"""What one denoising step computes: a model's shapes, its token counts, its batch and its step count.

A :class:`Workload` is the input of the cost model. It is built from a model preset and an output size
(``Workload.create("flux-dev", height=1024, width=1024)``) or from any registered family's config (the
tests use small ones); the family (``jaxdit.families``) says how an output size becomes token counts.
For the two families today:

- FLUX: latents are [16, H/8, W/8], packed into 2 x 2 patches: (H/16)(W/16) image tokens, joined with
  512 T5 tokens (``max_sequence_length``) in every attention layer.
- Wan 2.1: latents are [16, (F-1)/4 + 1, H/8, W/8], patches 1 x 2 x 2: 720p x 81 frames gives
  21 x 45 x 80 = 75,600 video tokens. Self-attention sees only these; the 512 umT5 tokens (and I2V's 257
  CLIP tokens) enter through cross-attention, which every sequence shard computes locally.

``branches`` is the number of forward passes per denoising step: 2 with classifier-free guidance (Wan
2.1's default, guide_scale 5.0), 1 for FLUX.1-dev, whose guidance is an embedded input (distilled), so
cfg parallelism has nothing to split there (xDiT refuses it for FLUX too).

``experts``: transformers of the same config the generation switches between (Wan 2.2 A14B: 2). Each
step runs one, so a step costs what one model's does; memory holds all of them unless
``offload_idle_expert`` keeps the idle ones in host memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdit import families
from jaxdit.families.base import ModelFamily

__all__ = ["ALIASES", "Workload"]

#: Short names accepted on the command line.
ALIASES = {
    "wan-1.3b": "wan2.1-t2v-1.3b",
    "wan-14b": "wan2.1-t2v-14b",
    "wan-i2v-14b": "wan2.1-i2v-14b",
    "wan2.2-5b": "wan2.2-ti2v-5b",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One generation's denoising work, as the cost model needs it.

    ``tokens``: the self-attention token groups (FLUX: (text, image); Wan: (video,)), i.e. what is
    sequence-sharded. ``context``: tokens every shard attends to locally in cross-attention (Wan's text,
    plus I2V's image tokens as a second entry). ``requests``: independent generations in the batch (only
    data parallelism splits them). ``dtype``: the weights' and activations' dtype as served.
    """

    name: str
    family: ModelFamily
    model: Any  # the family's config
    tokens: tuple[int, ...]
    context: tuple[int, ...] = ()
    branches: int = 1
    requests: int = 1
    steps: int = 28
    dtype: str = "bfloat16"
    size: tuple[int, int, int] = (0, 0, 1)  # (height, width, frames), for display
    experts: int = 1
    offload_idle_expert: bool = False
    fp8: bool = False  # the blocks' linear weights in FP8 (``--quantize fp8``)
    #: ``--fp8_skip_steps``: the FP8 layers' original weights held beside them for the bf16 steps
    fp8_retained: bool = False

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise ValueError(f"experts must be >= 1, got {self.experts}")
        if self.offload_idle_expert and self.experts == 1:
            raise ValueError(f"{self.name} has one transformer: there is no idle expert to offload")
        if self.branches not in (1, 2):
            raise ValueError(f"branches must be 1 (no CFG) or 2 (CFG), got {self.branches}")
        for name in ("requests", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tokens or min(self.tokens) < 1 or min(self.context, default=1) < 1:
            raise ValueError(
                f"every token group must hold >= 1 token: tokens={self.tokens}, context={self.context}"
            )
        if self.fp8_retained and not self.fp8:
            raise ValueError("fp8_retained (--fp8_skip_steps) holds FP8 weights' originals: it needs fp8")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    # ------------------------------------------------------------------ shapes
    @property
    def hidden(self) -> int:
        return self.family.hidden(self.model)

    @property
    def mlp_hidden(self) -> int:
        return self.family.mlp_hidden(self.model)

    @property
    def num_heads(self) -> int:
        return self.model.num_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def stack_depths(self) -> tuple[int, ...]:
        """Blocks per stack (``STACKS`` order)."""
        return self.family.stack_depths(self.model)

    @property
    def attention_layers(self) -> int:
        """Layers with a sequence-parallel self-attention (every block of every stack)."""
        return sum(self.stack_depths)

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
        return self.family.output_features(self.model)

    @property
    def resident_experts(self) -> int:
        """Experts whose parameters stay on the devices: all, or the running one when offloading."""
        return 1 if self.offload_idle_expert else self.experts

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def describe(self) -> str:
        h, w, f = self.size
        frames = f" x {f} frames" if self.family.makes_video else ""
        cfg = "CFG: 2 branches" if self.branches == 2 else "no CFG"
        if self.experts > 1:
            where = "the idle one offloaded to host" if self.offload_idle_expert else "all resident"
            cfg += f", {self.experts} experts ({where})"
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
        offload_idle_expert: bool = False,
        fp8: bool = False,
        fp8_retained: bool = False,
    ) -> Workload:
        """A preset of any registered family (``flux-dev``, ``wan2.1-t2v-14b``, ...) at an output size;
        unset arguments take the preset's defaults (its experts too)."""
        name = ALIASES.get(model, model)
        family, preset = families.preset(name)
        return cls.for_config(
            family.preset_config(name),
            name=name,
            # Unset (None) takes the preset's; a 0 given is refused below, never read as "unset".
            height=preset.height if height is None else height,
            width=preset.width if width is None else width,
            frames=frames if frames is not None else preset.frames,
            steps=preset.steps if steps is None else steps,
            branches=branches or preset.branches,
            requests=requests,
            text_tokens=text_tokens,
            dtype=dtype,
            experts=preset.experts,
            offload_idle_expert=offload_idle_expert,
            fp8=fp8,
            fp8_retained=fp8_retained,
            family=family,  # the preset's: variants sharing a config class (Kontext) are not told by it
        )

    @classmethod
    def for_config(
        cls,
        config: Any,
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
        experts: int = 1,
        offload_idle_expert: bool = False,
        family: Any = None,
        fp8: bool = False,
        fp8_retained: bool = False,
    ) -> Workload:
        """Any architecture of a registered family at an output size (pixels; frames for video);
        ``family``: the registered family (default: the one whose config class ``config`` is)."""
        family = family or families.for_config(config)
        factor = family.size_multiple(None)
        if height % factor or width % factor or height < factor or width < factor:
            raise ValueError(f"height and width must be positive multiples of {factor}; got {height}x{width}")
        tokens, context = family.workload_shape(config, height, width, frames, text_tokens)
        return cls(
            name=name,
            family=family,
            model=config,
            tokens=tokens,
            context=context,
            branches=branches or family.default_branches,
            requests=requests,
            steps=steps,
            dtype=dtype,
            size=(height, width, frames),
            experts=experts,
            offload_idle_expert=offload_idle_expert,
            fp8=fp8,
            fp8_retained=fp8_retained,
        )
