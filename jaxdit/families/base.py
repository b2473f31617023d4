"""The contract a model family fulfils to plug into jaxdit: :class:`ModelFamily`.

A family (FLUX.1, Wan) is ONE object, registered in ``jaxdit.families``; ``jaxdit.load_transformer``,
``jaxdit generate``, ``jaxdit plan`` and the service look it up there and never name it. Its pieces live
in the layer each belongs to, one family-named file per layer:

- ``jaxdit/models/<family>.py``: config + presets, the staged forward (embed -> block stacks -> output),
  the forward's input layout (``FORWARD_INPUTS``);
- ``converters/<family>.py``: checkpoint detection and key tables, and its ``CHECKPOINTS`` format;
- ``jaxdit/pipelines/<family>.py``: the pipeline (conditioning, latents, sampler) on the shared loop, its
  ``from_pretrained`` and the downloaded folders it recognises;
- ``jaxdit/families/<family>.py``: this object, which ties them together and adds what only it knows:
  the diffusers call surface of its forward, the presets and defaults of ``jaxdit generate`` and its cost
  terms for ``jaxdit plan``.

Adding a family is adding those files and one ``register`` call (docs/architecture.md walks through it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from jax.sharding import Mesh

from converters.checkpoints import CheckpointFormat
from jaxdit.loading import checkpoint_config
from jaxdit.models.partitioning import logical_axes
from jaxdit.pipelines.model_folder import FolderClass, ModelFolder

__all__ = [
    "ModelDimensions",
    "ModelFamily",
    "Preset",
    "Reduction",
    "StepTerms",
    "check_calibrated_caches",
    "model_dimensions",
]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named full-size model (its config is the config class's preset of that name) and the defaults
    of a generation with it (the model's published ones)."""

    steps: int
    height: int
    width: int
    frames: int = 1
    #: Forward passes per step by default: 2 with classifier-free guidance, 1 without (FLUX.1-dev's
    #: guidance is an embedded input).
    branches: int = 1
    #: The folder kind (``ModelFolder.kind``) a downloaded copy of this model has.
    kind: str = ""
    #: Transformers of this config the model switches between (Wan 2.2 A14B's two experts): what ``jaxdit
    #: plan`` counts in memory when they are all resident.
    experts: int = 1


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A tensor-parallel all-reduce the family's blocks run: ``per_block`` of them in every block of stack
    ``stack``, each of ``elements`` fp32 values (per device)."""

    what: str
    stack: int
    per_block: int
    elements: int


@dataclasses.dataclass(frozen=True)
class StepTerms:
    """One denoising step's family-specific costs on one device (``jaxdit.plan.cost`` adds the rest).

    FLOPs count matmuls only (2 per multiply-add), replicated work included; ``block_flops`` and
    ``param_block_bytes`` hold one block of each stack (``STACKS`` order). ``context_bytes``: activation
    memory of cross-attention context (embedded tokens and their K/V) per device.
    """

    nonblock_flops: float
    block_flops: tuple[float, ...]
    attention_flops: float  # one self-attention layer, as the kernel tiles it
    param_nonblock_bytes: int
    param_block_bytes: tuple[int, ...]
    reductions: tuple[Reduction, ...] = ()
    context_bytes: int = 0
    #: Per stack, this device's tokens its self-attention covers (Z-Image's refiners attend over one token
    #: group); empty: every stack attends over all of them.
    attention_tokens: tuple[int, ...] = ()
    #: Whether self-attention takes a per-sample key mask (prompts that keep their own lengths): the
    #: forward gathers it once over the sequence axes (``ShardContext.with_key_mask``).
    masked_keys: bool = False


@dataclasses.dataclass(frozen=True)
class ModelDimensions:
    """What ``jaxdit plan`` needs of a transformer's widths, read off its abstract parameters' logical
    axes (so a family states them nowhere twice)."""

    hidden: int
    mlp_hidden: int
    stack_depths: tuple[int, ...]


def model_dimensions(checkpoints: CheckpointFormat, config: Any) -> ModelDimensions:
    """The "embed" and "mlp" axes' sizes and each of ``STACKS``' "layers" axis, from the abstract model
    (shapes only, nothing allocated); a model whose axes disagree is an error, not a guess."""
    return _dimensions(checkpoints.name, config, checkpoints.abstract_model)


@functools.lru_cache(maxsize=64)
def _dimensions(name: str, config: Any, abstract_model: Callable[..., Any]) -> ModelDimensions:
    import jax.numpy as jnp
    from flax import nnx

    model = abstract_model(config, jnp.float32)

    def sizes(module: Any) -> dict[str | None, set[int]]:
        found: dict[str | None, set[int]] = {}
        for _, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
            for axis, size in zip(logical_axes(variable), variable.shape, strict=True):
                found.setdefault(axis, set()).add(size)
        return found

    def one(found: dict[str | None, set[int]], axis: str, where: str) -> int:
        values = found.get(axis, set())
        if len(values) != 1:
            raise ValueError(f"{where}: the {axis!r} axis has sizes {sorted(values)}; expected one")
        return next(iter(values))

    everything = sizes(model)
    name = type(model).__name__  # for messages
    depths = tuple(one(sizes(getattr(model, s)), "layers", f"{name}.{s}") for s in model.STACKS)
    return ModelDimensions(one(everything, "embed", name), one(everything, "mlp", name), depths)


def check_calibrated_caches(request: Any, display: str, *, magcache_published: bool = False) -> None:
    """For a family with no published TeaCache coefficients or MagCache ratios (FLUX.2, HunyuanVideo 1.5):
    either cache without them is refused before any weight loads, naming the calibration that records
    them."""
    cache = getattr(request, "cache", None)
    for title, given, calibrate, needs in (
        ("TeaCache", "coefficients", "calibrate_teacache", "teacache_coefficients"),
        ("MagCache", "ratios", "calibrate_magcache", "magcache_ratios"),
    ):
        if title == "MagCache" and magcache_published:
            continue  # the model's published ratios (``magcache_defaults``)
        if getattr(cache, "title", None) == title and getattr(cache, given) is None:
            raise ValueError(
                f"{title} has no published numbers for {display}: record them once with --{calibrate} "
                f"FILE, then pass --{needs} FILE"
            )


class ModelFamily:
    """One model family (see the module docstring). Subclasses set the attributes and methods below."""

    #: Registry key; also the ``family`` an orbax checkpoint written by ``jaxdit convert`` records.
    name: ClassVar[str]
    #: For messages ("FLUX.1", "Wan").
    display: ClassVar[str]
    #: How its checkpoints are recognised and read (``converters/<family>.py``).
    checkpoints: ClassVar[CheckpointFormat]
    #: The LoRA key layouts people share for it (``converters/lora/<family>.py``, registered there); None:
    #: no LoRA support.
    lora: ClassVar[Any] = None
    #: Named full-size models.
    presets: ClassVar[Mapping[str, Preset]]
    #: diffusers pipeline ``_class_name`` -> what it is (``model_index.json`` recognition).
    folder_classes: ClassVar[Mapping[str, FolderClass]]
    #: The family's pipeline class (``from_pretrained``, ``from_checkpoint``, ``__call__``).
    pipeline_class: ClassVar[type]
    #: Its transformer laid out in PipeFusion's stage slots (a ``StagedModel``); None: no PipeFusion.
    staged_model: ClassVar[type | None] = None
    #: Images or videos (what ``jaxdit generate`` writes).
    makes_video: ClassVar[bool] = False
    #: Frames per second of the videos it makes.
    fps: ClassVar[int] = 16
    #: The call argument that, above 1, turns classifier-free guidance on, and what CFG needs, in words.
    cfg_scale_argument: ClassVar[str]
    cfg_needs: ClassVar[str]
    #: The self-attention token group the prediction covers (``workload_shape``'s order): the last for
    #: FLUX and Wan, the first for Z-Image (its joint sequence is [image; caption]).
    prediction_group: ClassVar[int] = -1
    #: CFG runs when that argument is above this (diffusers' pipelines: 1; Z-Image's guides for any g > 0).
    cfg_above: ClassVar[float] = 1.0
    #: Forward passes per step a generation of this family makes by default (2: classifier-free guidance).
    default_branches: ClassVar[int] = 1
    #: Why CFG parallelism has nothing to split by default, if the family says so (for ``jaxdit plan``).
    cfg_note: ClassVar[str] = ""
    #: For a guidance-distilled model (one branch, the scale an embedded input): the line that refuses
    #: a second branch's flags (``--negative_prompt``, ``--true_cfg_scale``, ``--use_cfg_parallel``).
    guidance_distilled: ClassVar[str | None] = None
    #: Arrays a ``--prompt_embeds`` file may hold (the pipeline's call arguments of those names).
    embedding_names: ClassVar[tuple[str, ...]]
    #: The most text tokens ``--max_sequence_length`` may ask for, and why, in words (None: the T5
    #: encoders' 512).
    text_token_limit: ClassVar[tuple[int, str] | None] = None
    #: A prompt that shows what the model takes (start-up checks of ``jaxdit serve``, examples).
    example_prompt: ClassVar[str] = "a photograph"
    #: A regular expression every prompt of the service must match, and what it means in words (None:
    #: any text); a negative prompt may also be empty.
    prompt_pattern: ClassVar[tuple[str, str] | None] = None
    #: The feature caches its transformer serves (``jaxdit.cache.hooks``: the hooks each needs); a cache
    #: not named here is refused before any weight loads.
    caches: ClassVar[frozenset[str]] = frozenset()
    #: Feature-cache thresholds where this family's measured ones differ from the cache's own default
    #: (cache name -> threshold).
    cache_thresholds: ClassVar[Mapping[str, float]] = {}
    #: Other feature-cache settings where this family's measured ones differ from the cache's defaults
    #: (cache name -> keyword arguments of its config, e.g. DBCache's ``fn`` / ``bn`` for a shallow model).
    cache_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    #: Several pictures of one run are written as a grid of this many columns, each pixel this many
    #: times over (a tiny model's pictures are small).
    grid_columns: ClassVar[int] = 4
    #: Whether a folder's pipeline takes several prompts in one run (``--prompt`` repeated: a list, one
    #: picture each, written as a grid); families without it are told to give one.
    several_prompts: ClassVar[bool] = False
    grid_scale: ClassVar[int] = 1
    #: Whether the service draws only the default size (a model trained at one size).
    serves_default_size_only: ClassVar[bool] = False
    #: Whether ``jaxdit serve`` runs the family's image-to-video folders (a video job with a first frame;
    #: the others are refused at start-up).
    serves_image_to_video: ClassVar[bool] = False
    #: Whether ``jaxdit generate`` prices a request with the planner's memory model before loading (a
    #: bundled model bounds its requests by its own limits instead).
    checks_memory: ClassVar[bool] = True

    #: The family whose architecture, config class and checkpoints this one shares (None: its own).
    #: Lookups by config or checkpoint find the base family; a variant is found by its name or folder.
    variant_of: ClassVar[str | None] = None

    # ------------------------------------------------------------------ a bundled model
    #: Whether the family ships its model inside jaxdit: ``--model <name>`` without ``--weights`` runs it.
    bundled: ClassVar[bool] = False

    def bundled_pipeline(self, mesh: Mesh, **options: Any) -> Any:
        """The bundled model's pipeline on ``mesh`` (``bundled`` families only)."""
        raise NotImplementedError(f"{self.display} ships no model; pass --weights")

    def bundled_config(self) -> Any:
        """The bundled model's transformer config (``bundled`` families only)."""
        raise NotImplementedError(f"{self.display} ships no model")

    def generate_defaults(self, request: Any) -> dict[str, Any]:
        """Call arguments a ``jaxdit generate`` request takes by default beyond the pipeline's own call
        defaults (a bundled model's training record); ``request`` is the ``GenerateRequest``."""
        return {}

    def prompt_batch(self, prompt: str | list[str]) -> int:
        """Pictures a run's prompt (or list of prompts) asks for (what ``--data_parallel_degree`` must divide)."""
        return len(prompt) if isinstance(prompt, (list, tuple)) else 1

    def default_output(self, makes_pixels: bool) -> str:
        """The output file of a run without ``--output``."""
        if not makes_pixels:
            return "latents.npy"
        return "video.mp4" if self.makes_video else "image.png"

    def report(self, request: Any, result: Any, say: Callable[[str], None]) -> None:
        """What the family says about a finished run beyond the shared lines (a bundled model's judge)."""

    def describe_call(self, request: Any) -> str | None:
        """A line said before a run starts, if the request means something the family should explain."""
        return None

    def preset_config(self, name: str) -> Any:
        """The config of preset ``name`` (read when asked, so a test may register a tiny one)."""
        return self.checkpoints.config_class.preset(name)

    def checkpoint_config(self, path: Path) -> Any:
        """The config of a transformer checkpoint of this family, in any layout it reads (``jaxdit convert``
        folders included), from its config file or headers only."""
        return checkpoint_config(path, self.checkpoints)

    def original_folder(self, root: Path) -> ModelFolder | None:
        """A folder in the family's own (non-diffusers) release layout, else None."""
        return None

    def check_folder(self, folder: ModelFolder) -> None:
        """What its folder classes cannot say (e.g. a variant the family does not run): raise ValueError."""

    def image_input(self, folder: ModelFolder) -> str:
        """Whether a folder's pipeline takes a picture (``--image``): "required" (image-to-video),
        "optional" (text- or image-to-video), "several" (any number of reference pictures, none
        included) or "none"."""
        return "required" if folder.takes_image else "none"

    def image_count(self, folder: ModelFolder) -> tuple[int, int | None]:
        """(least, most) input pictures a call of the folder's pipeline takes (None: no bound of its own),
        from :meth:`image_input` unless a family knows better (``jaxdit serve`` checks a request's
        ``image`` field against it)."""
        return {"none": (0, 0), "optional": (0, 1), "required": (1, 1), "several": (0, None)}[
            self.image_input(folder)
        ]

    def picture_problem(self, folder: ModelFolder, width: int, height: int) -> str | None:
        """Why the folder's pipeline cannot take a ``width`` x ``height`` input picture, else None (a size
        its resizing cannot handle: ``jaxdit serve`` refuses such a picture before it is queued)."""
        return None

    def picture_output_size(self, folder: ModelFolder, width: int, height: int) -> tuple[int, int] | None:
        """The (width, height) the folder's pipeline draws at for a ``width`` x ``height`` input picture
        where the picture decides it (a request's ``size`` may then only repeat it), else None."""
        return None

    @property
    def pipefusion_caches(self) -> frozenset[str]:
        """The feature caches its PipeFusion runner takes: its pipeline class's ``pipefusion_caches`` (one
        source for ``jaxdit generate``, ``jaxdit plan`` and ``pipe(..., cache=)``)."""
        return self.pipeline_class.pipefusion_caches

    def video_fps(self, folder: ModelFolder | None) -> int:
        """Frames per second of the videos a folder's model makes (default: the family's ``fps``)."""
        return self.fps

    # ------------------------------------------------------------------ forward
    def wrap(self, model: Any, mesh: Mesh, **options: Any) -> Callable[..., Any]:
        """The diffusers-style callable of a loaded model (``jaxdit.load_transformer``'s result)."""
        raise NotImplementedError

    def checkpoint_pipeline(self, config: Any) -> type:
        """The pipeline class that runs a transformer checkpoint alone of ``config`` (``jaxdit generate
        --weights CHECKPOINT --prompt_embeds FILE``): ``pipeline_class`` unless the family has several."""
        return self.pipeline_class

    def bare_pipeline(self, model: Any, mesh: Mesh, **options: Any) -> Any:
        """The family's pipeline around a loaded (or abstract) model, without encoders or VAE: calls take
        prompt embeddings and return latents."""
        return self.pipeline_class(model, mesh, **options)

    def example_request(self, workload: Any) -> Any:
        """A ``GenerationRequest`` of ``workload``'s shape with zero embeddings: what ``jaxdit plan
        --verify`` lowers the real denoising step with."""
        raise NotImplementedError

    def cache_hooks(self, model: Any) -> Any:
        """What answers the feature caches' questions about ``model`` (``jaxdit.cache.hooks``' Protocols
        for :attr:`caches`): the transformer itself, whose hook methods know its streams."""
        return model

    # ------------------------------------------------------------------ jaxdit generate
    def size_multiple(self, folder: ModelFolder | None) -> int:
        """Height and width must be multiples of this (the VAE's factor x the patch size)."""
        raise NotImplementedError

    def check_generate(self, request: Any, config: Any | None, parallel: Any) -> None:
        """The family's own checks of a ``jaxdit generate`` request (before jax starts); ``config`` is
        the transformer's when known (a preset or an embeddings run), else None."""

    def uses_cfg(
        self,
        call: Any,
        folder: ModelFolder | None = None,
        config: Any = None,
        negative_embeds: bool = False,
    ) -> bool:
        """Whether the pipeline call ``call`` runs classifier-free guidance (two branches per step), as
        the family's pipeline decides it: its ``cfg_scale_argument`` above ``cfg_above``, and for a
        ``true_cfg_scale`` family a negative prompt too (``negative_embeds``: the run's embeddings file
        holds negative ones). ``folder``: the model's folder, where it is one; ``config``: the
        transformer's, where known (a family whose folder or config can say "one branch whatever the
        scale" reads them here)."""
        cfg = getattr(call, self.cfg_scale_argument) > self.cfg_above
        if self.cfg_scale_argument == "true_cfg_scale":
            cfg = cfg and (call.negative_prompt is not None or negative_embeds)
        return cfg

    def guidance_scale_ignored(self, config: Any, label: str) -> str | None:
        """Why ``guidance_scale`` would change nothing for the model ``label`` of ``config`` (a message for
        ``jaxdit generate`` to refuse it with; ``jaxdit serve``'s card says the scale is not taken), or
        None when the model reads it (the default: as a classifier-free guidance scale)."""
        return None

    def check_pipefusion(self, request: Any, config: Any, parallel: Any, multiple: int) -> None:
        """PipeFusion's options against the model and the request's size (before jax starts); ``multiple``
        is :meth:`size_multiple`'s (pixels per token row)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ jaxdit plan
    def workload_shape(
        self, config: Any, height: int, width: int, frames: int, text_tokens: int | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(self-attention token groups, cross-attention context lengths) of one generation."""
        raise NotImplementedError

    def hidden(self, config: Any) -> int:
        """The residual stream's width: the size of the model's "embed" logical axis."""
        return model_dimensions(self.checkpoints, config).hidden

    def mlp_hidden(self, config: Any) -> int:
        """The MLP's inner width: the size of the model's "mlp" logical axis."""
        return model_dimensions(self.checkpoints, config).mlp_hidden

    def output_features(self, config: Any) -> int:
        """Features of each predicted token (what CFG exchanges and PipeFusion hands back per token)."""
        raise NotImplementedError

    def stack_depths(self, config: Any) -> tuple[int, ...]:
        """Blocks per stack, in the model's ``STACKS`` order (PipeFusion makes one pass per stack): each
        stack's leading "layers" axis."""
        return model_dimensions(self.checkpoints, config).stack_depths

    def pipefusion_unsupported(self, workload: Any) -> str | None:
        """Why the family's PipeFusion runner cannot run ``workload`` (None: it can)."""
        return None

    def pipefusion_max_stages(self, workload: Any) -> int:
        """The most PipeFusion stages ``jaxdit plan`` splits the stacks over: by default the shallowest
        stack's blocks (no stage left with padded slots alone of a stack)."""
        return min(s for s in workload.stack_depths if s > 0)

    def pipefusion_patches(self, workload: Any, parallel: Any) -> int:
        """Patches per step ``jaxdit plan`` prices (and ``--verify`` compiles) PipeFusion with: a full
        pipeline, V x P (a pass per stack), unless the family's runner picks another count by default."""
        return len(workload.stack_depths) * parallel.pipefusion

    def prediction_dtype(self, dtype: str) -> str:
        """The dtype the model's prediction leaves in, for a model served in ``dtype``."""
        return dtype

    def step_terms(self, workload: Any, parallel: Any, shapes: Any) -> StepTerms:
        """The step's FLOPs, parameter bytes and tensor all-reduces on one device of ``parallel``;
        ``shapes`` are the per-device sizes (``jaxdit.plan.cost.Shapes``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<model family {self.name}>"
