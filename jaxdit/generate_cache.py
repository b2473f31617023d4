"""``jaxdit generate``'s feature-cache flags: what they add to the parser, the cache config they make, and
their checks (flag combinations before anything runs, the family's hooks before any weight loads).

``--cache NAME`` picks one of :data:`jaxdit.cache.CACHES` (``--use_fbcache`` / ``--use_teacache`` remain
as spellings of ``--cache fbcache`` / ``--cache teacache``); ``--cache_threshold`` its threshold;
``--taylor_order`` TaylorSeer's order (alone, or forecasting under First-Block-Cache, DBCache, MagCache);
``--taylorseer_interval`` TaylorSeer's N; ``--dbcache_fn`` / ``--dbcache_bn`` DBCache's Fn / Bn;
``--magcache_ratios FILE`` MagCache's ratios from a file; ``--calibrate_magcache FILE`` runs every block
and records the model's magnitude ratios into FILE (what ``--magcache_ratios`` reads);
``--calibrate_teacache FILE`` likewise fits TeaCache's polynomial into FILE (what
``--teacache_coefficients`` reads; ``jaxdit.cache.calibrate``).
Unset numbers take the family's measured ones (``ModelFamily.cache_thresholds`` / ``cache_options``),
else the cache's own defaults.
"""

from __future__ import annotations

import math
from typing import Any

from jaxdit.cache.hooks import check_family

__all__ = ["add_arguments", "cache_name", "check_flags", "check_for_family", "make_cache", "save_calibration"]

#: Flag -> the caches it applies to.
_APPLIES = {
    "taylor_order": ("taylorseer", "fbcache", "dbcache", "magcache"),
    "taylorseer_interval": ("taylorseer",),
    "dbcache_fn": ("dbcache",),
    "dbcache_bn": ("dbcache",),
    "magcache_ratios": ("magcache",),
    "teacache_coefficients": ("teacache",),
}
#: The calibration flags: each runs every block and writes what the cache's own flag reads.
_CALIBRATIONS = {"calibrate_magcache": "magcache", "calibrate_teacache": "teacache"}


def add_arguments(group: Any, flag: Any) -> None:
    """The flags, added to ``group`` with the CLI's ``flag(group, name, **kwargs)``."""
    from jaxdit.cache import CACHES

    group.add_argument(
        "--cache",
        dest="feature_cache",
        default=None,
        choices=sorted(CACHES),
        help="a feature cache: fbcache (First-Block-Cache), teacache, magcache (the model's shipped "
        "magnitude ratios), taylorseer (forecast skipped steps), dbcache (cache-dit's Fn/Bn)",
    )
    flag(group, "taylor_order", type=int, default=None, help="TaylorSeer's order (default 1; 0: reuse)")
    flag(
        group, "taylorseer_interval", type=int, default=None, help="TaylorSeer: full step every N (default 3)"
    )
    flag(
        group, "dbcache_fn", type=int, default=None, help="DBCache: front blocks always computed (default 8)"
    )
    flag(group, "dbcache_bn", type=int, default=None, help="DBCache: back blocks always computed (default 0)")
    flag(
        group,
        "magcache_ratios",
        default=None,
        help="MagCache: a ratios file (--calibrate_magcache's) or a published set, e.g. flux-kontext-dev",
    )
    flag(
        group,
        "calibrate_magcache",
        default=None,
        metavar="FILE",
        help="run every block and record the model's MagCache ratios into FILE (JSON)",
    )
    flag(
        group,
        "teacache_coefficients",
        default=None,
        metavar="FILE",
        help="TeaCache: the polynomial (and threshold) a --calibrate_teacache run wrote",
    )
    flag(
        group,
        "calibrate_teacache",
        default=None,
        metavar="FILE",
        help="run every block and fit the model's TeaCache polynomial into FILE (JSON; 6 steps or more)",
    )


def cache_name(r: Any) -> str | None:
    """The cache the flags ask for, by name (None: no cache)."""
    if r.feature_cache is not None:
        return r.feature_cache
    return "fbcache" if r.use_fbcache else "teacache" if r.use_teacache else None


def check_flags(r: Any, pipefusion: int) -> None:
    """Flag combinations (no family needed): one line naming the problem."""
    asked = [n for n, on in (("--use_fbcache", r.use_fbcache), ("--use_teacache", r.use_teacache)) if on]
    if r.feature_cache is not None:
        asked.append(f"--cache {r.feature_cache}")
    calibrations = [flag for flag in _CALIBRATIONS if getattr(r, flag) is not None]
    asked += [f"--{flag}" for flag in calibrations]
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(asked)} are two caches: pick one")
    name = cache_name(r)
    if r.cache_threshold is not None:
        if name is None:
            raise ValueError(
                "--cache_threshold needs a cache: add --cache NAME (or --use_fbcache / --use_teacache)"
            )
        if name == "taylorseer":
            raise ValueError("TaylorSeer has no threshold: its schedule is --taylorseer_interval")
        if not math.isfinite(r.cache_threshold) or r.cache_threshold <= 0:
            raise ValueError(f"--cache_threshold must be a positive number, got {r.cache_threshold}")
    for option, caches in _APPLIES.items():
        if getattr(r, option) is not None and name not in caches:
            raise ValueError(
                f"--{option} applies to --cache {' / '.join(caches)}; the request asks for {name}"
            )
    if (name is not None or calibrations) and pipefusion > 1:
        from jaxdit.pipelines.pipefusion.cache import refusal

        asked = {"calibrate_magcache": "magcache-calibration", "calibrate_teacache": "teacache-calibration"}
        reason = refusal(asked[calibrations[0]] if calibrations else name)
        if reason is not None:
            raise ValueError(f"--pipefusion_parallel_degree {pipefusion} with --cache {name}: {reason}")
    for flag in calibrations:
        from jaxdit.pipelines import preflight

        preflight.check_writable(getattr(r, flag))


def make_cache(r: Any) -> Any:
    """The cache config the flags make (``jaxdit.cache``), or None; raises ValueError on a bad value."""
    from jaxdit.cache import CACHES
    from jaxdit.cache.magcache import MagCacheCalibration
    from jaxdit.cache.policies import TeaCacheCalibration

    if r.calibrate_magcache is not None:
        return MagCacheCalibration()
    if r.calibrate_teacache is not None:
        return TeaCacheCalibration()
    name = cache_name(r)
    if name is None:
        return None
    options = dict(r.family.cache_options.get(name, {}))
    threshold = r.cache_threshold
    if threshold is None:
        threshold = r.family.cache_thresholds.get(name)
    if threshold is not None:
        options["threshold"] = threshold
    if r.taylor_order is not None:
        options["order" if name == "taylorseer" else "taylor_order"] = r.taylor_order
    for option, field in (("taylorseer_interval", "interval"), ("dbcache_fn", "fn"), ("dbcache_bn", "bn")):
        if getattr(r, option) is not None:
            options[field] = getattr(r, option)
    if r.magcache_ratios is not None:
        options["ratios"] = r.magcache_ratios
    if r.teacache_coefficients is not None:
        options["coefficients"] = r.teacache_coefficients
    return CACHES[name](**options)


def check_for_family(r: Any, config: Any) -> None:
    """The cache against the family (and its transformer's config when known), before any weight loads:
    a family without the cache's hooks is refused in one line; DBCache must leave a middle block."""
    calibrating = [cache for flag, cache in _CALIBRATIONS.items() if getattr(r, flag) is not None]
    name = cache_name(r) or (calibrating[0] if calibrating else None)
    if name is None:
        return
    check_family(r.family, name)
    pipefusion = getattr(r, "pipefusion_parallel_degree", 1)
    if pipefusion > 1:
        from jaxdit.families import FAMILIES
        from jaxdit.pipelines.pipefusion.cache import refusal

        have = [f.display for f in FAMILIES.values() if name in f.pipefusion_caches]
        reason = refusal(name, r.family.pipefusion_caches, r.family.display, have)
        if reason is not None:
            raise ValueError(f"--pipefusion_parallel_degree {pipefusion} with --cache {name}: {reason}")
    cache = make_cache(r)  # its own checks of the numbers
    if r.calibrate_teacache is not None:
        from jaxdit.cache.calibrate import TEACACHE_ORDER, teacache_steps_needed

        steps, needed = r.call().num_inference_steps, teacache_steps_needed()
        if steps is not None and steps < needed:
            raise ValueError(
                f"--calibrate_teacache fits a polynomial of order {TEACACHE_ORDER} to the changes between "
                f"steps: it needs --steps {needed} or more, got {steps}"
            )
    if name == "dbcache" and config is not None:
        depth = sum(r.family.stack_depths(config))
        if cache.fn + cache.bn >= depth:
            raise ValueError(
                f"DBCache F{cache.fn}B{cache.bn} leaves no middle block of {r.family.display}'s {depth} blocks: "
                "lower --dbcache_fn / --dbcache_bn"
            )


def save_calibration(r: Any, report: Any, say: Any) -> None:
    """After a ``--calibrate_magcache`` / ``--calibrate_teacache`` run: what it measured into the file the
    flag names (nothing for any other run)."""
    from jaxdit.cache.calibrate import fit_teacache, ratios_of, save_calibration_file, save_teacache_file

    if r.calibrate_teacache is not None:
        coefficients, inputs, outputs = fit_teacache(report)
        source = f"jaxdit generate --calibrate_teacache ({r.label})"
        save_teacache_file(r.calibrate_teacache, coefficients, inputs, outputs, source)
        say(f"TeaCache polynomial fitted to {len(inputs)} step changes written to {r.calibrate_teacache}")
        return
    if r.calibrate_magcache is None:
        return
    ratios = ratios_of(report)
    save_calibration_file(
        r.calibrate_magcache, ratios, source=f"jaxdit generate --calibrate_magcache ({r.label})"
    )
    say(f"MagCache ratios of {ratios.shape[1]} steps written to {r.calibrate_magcache}")
