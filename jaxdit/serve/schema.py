"""The service's requests: JSON bodies -> a checked :class:`Generation`, or a :class:`RequestError`
naming the field.

The shapes follow OpenAI's API, which clients already speak: ``POST /v1/images/generations`` takes
``prompt``, ``size`` ("WIDTHxHEIGHT"), ``n``, ``response_format`` (``b64_json``) and ``model``;
``POST /v1/videos`` takes ``prompt``, ``size``, ``seconds`` and ``model``. The diffusion fields are optional
keys beside them, named as ``jaxdit generate``'s flags: ``seed``, ``steps``, ``guidance`` (the pipeline's
``guidance_scale``), ``negative_prompt``, ``true_cfg_scale`` where the model takes it (FLUX), and
``num_frames`` for videos, a feature cache: ``cache`` (one of the caches the server was started to
allow, ``jaxdit serve --caches``) with ``cache_threshold``, and for a model that takes pictures (its
card's ``images``: Qwen-Image-Edit, FLUX.2, FLUX.1 Kontext; the first frame of a served image-to-video
model, HunyuanVideo 1.5 I2V) ``image``: one base64-encoded PNG, JPEG or WebP, or a list of them
(checked and decoded here: :mod:`jaxdit.serve.images`; then each size against the family's
``picture_problem``, the limits of the model's own resizing, and where the picture decides the size
drawn, ``size`` against it: ``ModelCard.picture_size``). A field left out takes the served model's default (its :class:`ModelCard`), the
default ``jaxdit generate`` uses. Unknown fields are refused by name (a typo such as ``step``
would otherwise be silently ignored).

Nothing here touches jax: every check runs in the HTTP handler, before a request is queued.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

from jaxdit.serve.errors import RequestError

__all__ = ["Generation", "ModelCard", "RequestError", "image_request", "parse_json", "video_request"]

IMAGE, VIDEO = "image", "video"
#: The largest seed: numpy's generators take any non-negative integer; JSON clients handle 2**53 safely.
MAX_SEED = 2**53 - 1
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What the served model accepts and its defaults (set by the engine from the model)."""

    name: str
    kind: str  # IMAGE or VIDEO
    default_size: tuple[int, int]  # (width, height)
    size_multiple: int
    default_steps: int
    default_guidance: float | None  # None: the model takes no guidance scale
    default_true_cfg: float | None = None  # None: the model takes no true_cfg_scale (FLUX's CFG scale)
    default_negative: str | None = None
    default_frames: int | None = None  # videos
    frame_multiple: int = 4  # videos: frames are frame_multiple * k + 1
    fps: int = 16
    #: The only sizes the model draws (tiny-digits: its training size); None: any multiple up to max_pixels.
    fixed_sizes: tuple[tuple[int, int], ...] | None = None
    #: A regular expression each prompt must match and its meaning in words (tiny-digits: one digit); a
    #: negative prompt may also be empty. None: any text.
    prompt_pattern: tuple[str, str] | None = None
    #: A prompt the model takes (warm-up requests).
    example_prompt: str = "a photograph"
    max_pixels: int = 2048 * 2048
    max_frames: int = 129
    max_steps: int = 100
    max_batch: int = 4
    max_prompt_chars: int = 2000
    max_guidance: float = 30.0
    #: False where the model ignores ``guidance`` (a FLUX model without a guidance embedding: FLUX.1-schnell,
    #: tiny-digits): a request giving it is refused rather than answered as if it had mattered.
    takes_guidance: bool = True
    #: The feature caches a request may name (``jaxdit serve --caches``); empty: none.
    caches: tuple[str, ...] = ()
    #: (least, most) input pictures a request sends as ``image`` (the family's ``image_count``, capped by
    #: the server's limit); (0, 0): the model takes none.
    images: tuple[int, int] = (0, 0)
    #: The largest input picture, in pixels (read from its header before it is decoded).
    max_image_pixels: int = 4096 * 4096
    #: The largest request body the application reads (then 413): base64 pictures make bodies large.
    max_body_bytes: int = 1 << 20
    #: The family's check of one input picture's (width, height): why the model cannot take it, or None
    #: (``ModelFamily.picture_problem``); None: every size is taken.
    picture_problem: Callable[[int, int], str | None] | None = None
    #: The (width, height) the model draws at for an input picture's (width, height) where the picture
    #: decides it (``ModelFamily.picture_output_size``: HunyuanVideo 1.5 I2V's size bucket), else None.
    picture_size: Callable[[int, int], tuple[int, int] | None] | None = None


@dataclasses.dataclass(frozen=True)
class Generation:
    """One checked request, as the devices run it (every default filled in)."""

    kind: str
    prompt: str
    width: int
    height: int
    steps: int
    guidance: float | None
    seed: int
    n: int = 1
    negative_prompt: str | None = None
    num_frames: int | None = None
    true_cfg_scale: float | None = None
    cache: str | None = None  # a feature cache (jaxdit.cache.CACHES), None: every block every step
    cache_threshold: float | None = None  # None: the family's measured one, else the cache's own
    #: Input pictures: each one's base64 text (checked: :mod:`jaxdit.serve.images`) and its (width,
    #: height), which the compiled programs depend on (reference tokens).
    images: tuple[str, ...] = ()
    image_sizes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:  # from JSON: lists back to (hashable) tuples
        object.__setattr__(self, "images", tuple(self.images))
        object.__setattr__(self, "image_sizes", tuple(tuple(s) for s in self.image_sizes))

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        return cls(**json.loads(text))


def parse_json(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """The request body as a JSON object; 415 for another content type, 400 for malformed JSON."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(
            f"Content-Type must be application/json, got {content_type or 'none'}",
            "Content-Type",
            status=415,
        )
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(f"the body is not UTF-8 text (byte {e.start})", "body") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", "body") from None
    except RecursionError:
        raise RequestError("the JSON is nested too deeply", "body") from None
    except ValueError as e:  # an integer past Python's digit limit (4300)
        raise RequestError(f"malformed JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}", "body")
    return body


# --------------------------------------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------------------------------------


def _integer(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {json.dumps(value)}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in {low}..{high}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {json.dumps(value)}", name)
    if not math.isfinite(value) or not low <= value <= high:
        raise RequestError(f"{name} must be a finite number in {low:g}..{high:g}, got {value}", name)
    return float(value)


def _text(body: dict, name: str, card: ModelCard, default: str | None, required: bool = False) -> str | None:
    if name not in body:
        if required:
            raise RequestError(f"{name} is required", name)
        return default
    value = body[name]
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {json.dumps(value)[:40]}", name)
    if len(value) > card.max_prompt_chars:
        raise RequestError(
            f"{name} is {len(value)} characters long; this server takes at most {card.max_prompt_chars}", name
        )
    if "\x00" in value:
        raise RequestError(f"{name} contains a NUL character", name)
    if card.prompt_pattern is None:
        return value
    pattern, meaning = card.prompt_pattern
    if not (re.fullmatch(pattern, value) or (name != "prompt" and value == "")):
        allowed = meaning + ("" if name == "prompt" else ", or empty (the unconditional branch)")
        raise RequestError(f"{card.name}: {name} must be {allowed}, got {json.dumps(value)[:40]}", name)
    return value.strip()


def _size(body: dict, card: ModelCard) -> tuple[int, int]:
    if "size" not in body or body["size"] in (None, "auto"):
        return card.default_size
    value = body["size"]
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise RequestError(f'size must be "WIDTHxHEIGHT" (e.g. "1024x768"), got {json.dumps(value)}', "size")
    width, height = int(match[1]), int(match[2])
    if card.fixed_sizes is not None:
        if (width, height) not in card.fixed_sizes:
            allowed = ", ".join(f"{w}x{h}" for w, h in card.fixed_sizes)
            raise RequestError(f"size {width}x{height}: {card.name} draws {allowed} only", "size")
        return width, height
    m = card.size_multiple
    if width < m or height < m or width % m or height % m:
        raise RequestError(
            f"size {width}x{height}: width and height must be positive multiples of {m}", "size"
        )
    if width * height > card.max_pixels:
        raise RequestError(
            f"size {width}x{height} has {width * height} pixels; this server draws at most {card.max_pixels}",
            "size",
        )
    return width, height


def _common(body: dict, card: ModelCard, allowed: set[str]) -> dict[str, Any]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(
            f"unknown field(s) {', '.join(unknown)}; this endpoint takes {', '.join(sorted(allowed))}",
            unknown[0],
        )
    if "guidance" in body and not card.takes_guidance:
        cfg = (
            " (for classifier-free guidance send true_cfg_scale)" if card.default_true_cfg is not None else ""
        )
        raise RequestError(
            f"guidance feeds FLUX.1-dev's guidance embedding; {card.name} has none, so it would change "
            f"nothing{cfg}",
            "guidance",
        )
    model = body.get("model")
    if model is not None and model != card.name:
        raise RequestError(f"model {json.dumps(model)[:60]}: this server serves {card.name!r}", "model")
    width, height = _size(body, card)
    true_cfg = None
    negative = _text(body, "negative_prompt", card, card.default_negative)
    if card.default_true_cfg is not None:
        true_cfg = _number(body, "true_cfg_scale", card.default_true_cfg, 0.0, card.max_guidance)
        # True CFG needs both; either alone runs one branch and answers the picture of the request
        # without it, so a field that would change nothing is refused (as jaxdit generate's flags).
        if "true_cfg_scale" in body and true_cfg > 1 and negative is None:
            raise RequestError(
                f"true_cfg_scale {true_cfg:g} needs a negative_prompt: without one it changes nothing",
                "true_cfg_scale",
            )
        if "negative_prompt" in body and true_cfg <= 1:
            raise RequestError(
                f"negative_prompt is used by classifier-free guidance, which true_cfg_scale {true_cfg:g} turns "
                "off: send true_cfg_scale > 1 too",
                "negative_prompt",
            )
    return dict(
        prompt=_text(body, "prompt", card, None, required=True),
        negative_prompt=negative,
        width=width,
        height=height,
        steps=_integer(body, "steps", card.default_steps, 1, card.max_steps),
        # None: a model with no guidance scale of its own (its CFG scale is true_cfg_scale), refused above.
        guidance=None
        if card.default_guidance is None
        else _number(body, "guidance", card.default_guidance, 0.0, card.max_guidance),
        seed=_integer(body, "seed", 0, 0, MAX_SEED),
        true_cfg_scale=true_cfg,
        **_cache(body, card),
    )


#: Above it a cache skips nearly every step (the published thresholds are 0.03-0.8): refused as a typo.
MAX_CACHE_THRESHOLD = 1.0


def _cache(body: dict, card: ModelCard) -> dict[str, Any]:
    """``cache`` and ``cache_threshold``: a cache the server allows, a finite threshold in (0, 1]."""
    name = body.get("cache")
    if name is not None:
        allowed = ", ".join(card.caches) if card.caches else "none (start it with --caches NAME[,...])"
        if not isinstance(name, str) or name not in card.caches:
            raise RequestError(
                f"cache {json.dumps(name)[:40]}: this server allows the feature caches {allowed}", "cache"
            )
    if "cache_threshold" not in body or body["cache_threshold"] is None:
        return dict(cache=name, cache_threshold=None)
    if name is None:
        raise RequestError("cache_threshold needs a cache: send cache too", "cache_threshold")
    if name == "taylorseer":
        raise RequestError(
            "TaylorSeer has no threshold (it runs every block every few steps)", "cache_threshold"
        )
    value = body["cache_threshold"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(
            f"cache_threshold must be a number, got {json.dumps(value)[:40]}", "cache_threshold"
        )
    if not math.isfinite(value) or not 0 < value <= MAX_CACHE_THRESHOLD:
        raise RequestError(
            f"cache_threshold must be a finite number in (0, {MAX_CACHE_THRESHOLD:g}], got {value}",
            "cache_threshold",
        )
    return dict(cache=name, cache_threshold=float(value))


#: Far above any clip a card serves (its frame limit refuses it by name); keeps ``seconds x fps`` finite.
MAX_SECONDS = 3600.0


def _seconds(value: Any) -> float:
    """OpenAI sends ``seconds`` as a string ("4"); a number is taken too."""
    try:
        seconds = float(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else -1
    except ValueError:
        seconds = -1
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
        raise RequestError(
            f"seconds must be a positive number, at most {MAX_SECONDS:g}, got {json.dumps(value)}", "seconds"
        )
    return seconds


_DIFFUSION_FIELDS = {
    "model", "prompt", "size", "seed", "steps", "guidance", "negative_prompt", "cache", "cache_threshold"
}  # fmt: skip


def _fields(card: ModelCard) -> set[str]:
    return _DIFFUSION_FIELDS | ({"true_cfg_scale"} if card.default_true_cfg is not None else set())


def image_request(body: dict[str, Any], card: ModelCard) -> Generation:
    """``POST /v1/images/generations``'s body, checked; defaults from ``card``."""
    if card.kind != IMAGE:
        raise RequestError(
            f"{card.name} makes videos: use POST /v1/videos", None, status=404, kind="invalid_request_error"
        )
    sends_images = _sends_images(body, card)
    allowed = _fields(card) | {"n", "response_format", "user"} | ({"image"} if card.images[1] else set())
    fields = _common(body, card, allowed)
    response_format = body.get("response_format", "b64_json")
    if response_format != "b64_json":
        raise RequestError(
            f"response_format {json.dumps(response_format)}: this server answers b64_json only (no image URLs)",
            "response_format",
        )
    if "user" in body and not isinstance(body["user"], str):
        raise RequestError("user must be a string", "user")
    n = _integer(body, "n", 1, 1, card.max_batch)
    pictures = _decode(body["image"], card) if sends_images else {}  # last: the cheap checks first
    return Generation(kind=IMAGE, n=n, **_sized_by_picture(body, card, fields, pictures), **pictures)


def _sized_by_picture(body: dict, card: ModelCard, fields: dict, pictures: dict) -> dict:
    """``fields`` with the size the first input picture decides (``card.picture_size``), where it does:
    a ``size`` the request gives must be that one."""
    sizes = pictures.get("image_sizes") or ()
    drawn = card.picture_size(*sizes[0]) if card.picture_size and sizes else None
    if drawn is None:
        return fields
    if body.get("size") not in (None, "auto") and (fields["width"], fields["height"]) != drawn:
        w, h = sizes[0]
        raise RequestError(
            f"size {fields['width']}x{fields['height']}: {card.name} draws a {w}x{h} picture at "
            f"{drawn[0]}x{drawn[1]} (its size bucket); leave size out or send that",
            "size",
        )
    if drawn[0] * drawn[1] > card.max_pixels:
        raise RequestError(
            f"image: {card.name} draws it at {drawn[0]}x{drawn[1]}, more than this server's "
            f"{card.max_pixels} pixels",
            "image",
        )
    return {**fields, "width": drawn[0], "height": drawn[1]}


def _sends_images(body: dict, card: ModelCard) -> bool:
    """Whether the request sends pictures, refusing them by name where the model takes none and their
    absence where it needs one (they are decoded by :func:`_decode`, after every other field)."""
    least, most = card.images
    if "image" in body and not most:
        raise RequestError(f"image: {card.name} takes no input pictures", "image")
    if "image" not in body:
        if least:
            does = "makes a video from a first frame" if card.kind == VIDEO else "edits pictures"
            raise RequestError(
                f"image is required: {card.name} {does} (send {least} to {most} base64-encoded "
                "PNG, JPEG or WebP files)",
                "image",
            )
        return False
    return True


def _decode(value: Any, card: ModelCard) -> dict[str, Any]:
    from jaxdit.serve import images

    decoded = images.decode_all(value, max(card.images[0], 1), card.images[1], card.max_image_pixels)
    for k, (_, p) in enumerate(decoded):
        width, height = p.shape[1], p.shape[0]
        problem = card.picture_problem and card.picture_problem(width, height)
        if problem:
            name = f"image[{k}]" if isinstance(value, list) else "image"
            raise RequestError(
                f"{name} is {width}x{height} pixels, which {card.name} cannot take: {problem}", "image"
            )
    return dict(
        images=tuple(text for text, _ in decoded),
        image_sizes=tuple((p.shape[1], p.shape[0]) for _, p in decoded),
    )


def video_request(body: dict[str, Any], card: ModelCard) -> Generation:
    """``POST /v1/videos``'s body, checked: ``num_frames`` (4k + 1), or OpenAI's ``seconds`` (frames at the
    model's frame rate, rounded to the nearest 4k + 1); defaults from ``card``."""
    if card.kind != VIDEO:
        raise RequestError(f"{card.name} makes images: use POST /v1/images/generations", None, status=404)
    sends_images = _sends_images(body, card)
    allowed = _fields(card) | {"num_frames", "seconds"} | ({"image"} if card.images[1] else set())
    fields = _common(body, card, allowed)
    if "num_frames" in body and "seconds" in body:
        raise RequestError("give num_frames or seconds, not both", "seconds")
    step = card.frame_multiple
    if "seconds" in body:
        seconds = _seconds(body["seconds"])
        longest = card.max_frames / card.fps
        # Compared before any rounding: 1e308 seconds would overflow the frame count.
        frames = step * max(1, round(seconds * card.fps / step)) + 1 if seconds <= 2 * longest else None
        if frames is None or frames > card.max_frames:
            frames = "more" if frames is None else frames
            raise RequestError(
                f"seconds {seconds:g} is {frames} frames at {card.fps} fps; this server makes at most "
                f"{card.max_frames} frames",
                "seconds",
            )
    else:
        frames = _integer(body, "num_frames", card.default_frames or 1, 1, card.max_frames)
        if (frames - 1) % step:
            low = frames - (frames - 1) % step
            raise RequestError(
                f"num_frames must be {step}k + 1 (the VAE folds every {step} frames after the first into one "
                f"latent frame), got {frames}; nearest: {low}, {low + step}",
                "num_frames",
            )
    pictures = _decode(body["image"], card) if sends_images else {}  # last: the cheap checks first
    fields = _sized_by_picture(body, card, fields, pictures)
    return Generation(kind=VIDEO, num_frames=frames, **fields, **pictures)
