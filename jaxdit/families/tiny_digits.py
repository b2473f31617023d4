"""``tiny-digits``, the bundled model, as a registered family (see ``jaxdit.families.base``).

It is FLUX.1's architecture (a preset of ``FluxConfig``), trained on scikit-learn's digits, shipped in
``jaxdit/assets/tiny-digits``: its model, converter and pipeline are FLUX's, so this file adds only what
the bundled model itself knows: digit prompts, its training record's sampling defaults, its size limits,
how its pictures are shown and the held-out judge that scores them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxdit.families.flux import FluxFamily
from jaxdit.models.flux import FluxConfig
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.model_folder import ModelFolder

__all__ = ["TINY_DIGITS", "TinyDigitsFamily"]

#: The training record fixes its sampling (pixel space, 16 x 16, CFG with the empty prompt).
DEFAULTS = dict(height=tiny.LATENT_SIZE, width=tiny.LATENT_SIZE, num_inference_steps=20, true_cfg_scale=3.0)
#: Bounds on what the bundled model is asked for: it was trained on 16x16 single digits; larger sizes
#: and prompts are allowed for experiments, not without limit (a 4000x4000 request wants ~20 GB).
MAX_SIZE = 128
MAX_DIGITS = 64
#: Its pixels come two to a token row (1-channel latents packed 2x2, no VAE).
PIXELS_PER_TOKEN = 2


class TinyDigitsFamily(FluxFamily):
    name = tiny.NAME
    display = "tiny-digits"
    presets: Mapping[str, Any] = {}
    folder_classes: Mapping[str, Any] = {}  # it is found by name, never in a downloaded folder
    variant_of = "flux"
    bundled = True
    serves_default_size_only = True
    checks_memory = False  # bounded by MAX_SIZE and MAX_DIGITS instead
    example_prompt = "0"
    prompt_pattern = (r"\s*\d\s*", "a single digit 0-9")
    #: Measured (scripts/cache_digits.py, README "Feature caching"): with 20 steps and 4 blocks
    #: First-Block-Cache skips nothing at FLUX.1-dev's 0.08; 0.2 is the smallest tried value that skips
    #: over 30% of block evaluations (the judge keeps 100%). TeaCache keeps FLUX's 0.4. DBCache (4 blocks:
    #: cache-dit's F8B0 and 8 warm-up steps cannot apply) is F1B0 with 2 warm-up steps at 0.3, the smallest
    #: tried value that skips at least 40% (scripts/cache_sweep.py). MagCache's threshold (0.25) is
    #: recorded with its calibrated ratios (jaxdit/cache/ratios/calibrated.json).
    cache_thresholds = {"fbcache": 0.2, "dbcache": 0.3}
    cache_options = {"dbcache": {"fn": 1, "bn": 0, "warmup": 2}}
    grid_columns = 10
    grid_scale = 8

    def bundled_pipeline(
        self,
        mesh: Mesh,
        *,
        kernel: Any = None,
        dtype: Any = None,
        compiler_options: Any = None,
        fp8: str | None = None,
    ) -> Any:
        return tiny.tiny_digits(mesh, kernel=kernel, dtype=dtype, compiler_options=compiler_options, fp8=fp8)

    def bundled_config(self) -> FluxConfig:
        return tiny.CONFIG

    def size_multiple(self, folder: ModelFolder | None) -> int:
        return PIXELS_PER_TOKEN

    def generate_defaults(self, request: Any) -> dict[str, Any]:
        # All ten digits when no prompt is given; the empty prompt is its unconditional branch, so CFG is
        # on by default.
        prompt = "0123456789" if request.prompt is None else request.prompt
        negative = "" if request.negative_prompt is None else request.negative_prompt
        return dict(DEFAULTS, prompt=prompt, negative_prompt=negative)

    def prompt_batch(self, prompt: str) -> int:
        return len(tiny.parse_prompt(prompt))

    def default_output(self, makes_pixels: bool) -> str:
        return "digits.png"

    def check_generate(self, request: Any, config: Any, parallel: Any) -> None:
        """Digit prompts, a one-digit (or empty) negative, and the size limits, before jax starts."""
        if request.embeddings is not None:
            raise ValueError("tiny-digits takes digit prompts, not --prompt_embeds")
        digits = tiny.parse_prompt(request.prompt)
        try:
            negative = tiny.parse_prompt(request.negative_prompt)
        except ValueError:
            negative = None
        if negative is None or len(negative) > 1:
            raise ValueError(
                "tiny-digits' --negative_prompt is one digit or empty (the label every picture is guided "
                f"away from), got {request.negative_prompt!r}"
            )
        if len(digits) > MAX_DIGITS:
            raise ValueError(
                f"tiny-digits draws at most {MAX_DIGITS} digits per run; the prompt has {len(digits)}"
            )
        for name in ("height", "width"):
            value = getattr(request, name)
            if value > MAX_SIZE:
                size = tiny.LATENT_SIZE
                raise ValueError(
                    f"tiny-digits was trained on {size}x{size} pictures; --{name} {value} is beyond the "
                    f"{MAX_SIZE} pixels it is allowed to try"
                )

    def describe_call(self, request: Any) -> str | None:
        if tiny.parse_prompt(request.prompt) == [tiny.NULL_LABEL]:  # "", "  ", ",,"
            return "tiny-digits: the empty prompt asks for no digit: one unconditional sample (the judge does not apply)"
        return None

    def report(self, request: Any, result: Any, say: Callable[[str], None]) -> None:
        """How many pictures a held-out classifier reads as the digit asked for. The judge is
        scikit-learn's (a test dependency): without it the run says so and writes its output all the same."""
        from jaxdit.pipelines.digits import DigitJudge

        labels = np.asarray(tiny.parse_prompt(request.prompt))
        size = tiny.LATENT_SIZE
        if result.images.shape[1:3] != (size, size):
            say(f"the held-out digit judge reads {size}x{size} pictures: not run at this size")
        elif (labels != tiny.NULL_LABEL).all():
            try:
                judge = DigitJudge()
            except ImportError as e:
                say(f"the held-out digit judge needs scikit-learn ({e}): not run")
                return
            judged = judge.predict(result.images)
            say(f"held-out digit judge recognises {int((judged == labels).sum())} of {len(labels)} as asked")


TINY_DIGITS = TinyDigitsFamily()
