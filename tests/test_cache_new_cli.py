"""``jaxdit generate``'s feature-cache flags for MagCache, TaylorSeer and DBCache on the bundled tiny-digits:
one run on cfg2 x ring2 x ulysses2 for the group, the defaults each flag makes, MagCache's calibration
(``--calibrate_magcache`` then ``--magcache_ratios``), and the checks: bad flags and a cache whose hooks
the family lacks are refused in one line before any device starts or weight loads.
"""

from __future__ import annotations

import pytest
import test_toy_family

from jaxdit.cache import DBCache, FirstBlockCache, MagCache, TaylorSeer
from jaxdit.cache.magcache import MagCacheCalibration
from jaxdit.generate import GenerateRequest

# The toy family's fixtures (registered for this module only).
toy, toy_files = test_toy_family.toy, test_toy_family.toy_files


def test_cli_runs_a_new_cache_on_cfg2_ring2_ulysses2(tmp_path, capsys):
    from jaxdit import cli

    """One run for the group (tests/test_cache_new_mesh.py runs each cache on the mesh through
    ``pipe``): MagCache with a threshold and TaylorSeer's forecast on top, from the flags."""
    out = tmp_path / "digits.png"
    argv = ["generate", "--use_cfg_parallel", "--ring_degree", "2", "--ulysses_degree", "2"]
    argv += ["--cache", "magcache", "--cache_threshold", "0.5", "--taylor_order", "1"]
    argv += ["--steps", "8", "--prompt", "71", "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "MagCache (threshold 0.5, Taylor order 1): " in printed, printed
    assert "decisions identical on all 8 devices" in printed and out.is_file()
    assert "held-out digit judge recognises" in printed


def test_each_cache_flag_makes_the_familys_default_config():
    """What ``--cache NAME`` asks of tiny-digits: its measured defaults (README "Feature caching")."""
    call = lambda **flags: GenerateRequest(**flags).call().cache
    assert call(feature_cache="dbcache") == DBCache(threshold=0.3, fn=1, bn=0, warmup=2)
    assert call(feature_cache="dbcache", dbcache_fn=2, dbcache_bn=1) == DBCache(0.3, fn=2, bn=1, warmup=2)
    assert call(feature_cache="taylorseer") == TaylorSeer()
    assert call(feature_cache="taylorseer", taylorseer_interval=4, taylor_order=2) == TaylorSeer(4, 2)
    assert call(feature_cache="magcache") == MagCache()
    assert call(feature_cache="fbcache", taylor_order=1) == FirstBlockCache(0.2, taylor_order=1)
    assert call(use_fbcache=True) == call(feature_cache="fbcache") == FirstBlockCache(0.2)
    assert call(calibrate_magcache="ratios.json") == MagCacheCalibration()


def test_calibrate_then_generate_with_the_recorded_ratios(tmp_path, capsys):
    """``--calibrate_magcache FILE`` computes every block and records 6 ratios; ``--magcache_ratios FILE``
    runs MagCache on them; step 0 has no previous residual and is recorded as 1."""
    from jaxdit import cli
    from jaxdit.cache.magcache import load_ratios

    ratios = tmp_path / "ratios.json"
    argv = ["generate", "--steps", "6", "--prompt", "5", "--output", str(tmp_path / "c.png")]
    assert cli.main([*argv, "--calibrate_magcache", str(ratios)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"MagCache ratios of 6 steps written to {ratios}" in printed
    entry = load_ratios(str(ratios))
    assert len(entry["ratios"]) == 1 and len(entry["ratios"][0]) == 6 and entry["ratios"][0][0] == 1.0
    assert all(0.5 < r < 2.0 for r in entry["ratios"][0][1:])
    assert cli.main([*argv, "--cache", "magcache", "--magcache_ratios", str(ratios)]) == 0
    assert "MagCache (threshold 0.12): " in capsys.readouterr().out  # the file's recorded default


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache", "taylorseer", "--cache_threshold", "0.2"], "TaylorSeer has no threshold"),
        (["--cache", "teacache", "--taylor_order", "1"], "--taylor_order applies to"),
        (["--cache", "fbcache", "--dbcache_fn", "2"], "--dbcache_fn applies to --cache dbcache"),
        (["--cache", "dbcache", "--dbcache_fn", "3", "--dbcache_bn", "1"], "leaves no middle block"),
        (["--cache", "magcache", "--use_fbcache"], "two caches"),
        (["--cache", "magcache", "--magcache_ratios", "/nonexistent.json"], "does not exist"),
        (["--cache", "taylorseer", "--taylorseer_interval", "0"], "interval must be"),
    ],
)
def test_bad_cache_flags_are_one_line_before_anything_runs(flags, message, capsys, monkeypatch):
    from jaxdit import cli, generate

    monkeypatch.setattr(generate, "start_devices", lambda r: pytest.fail("devices started"))
    assert cli.main(["generate", "--steps", "4", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_a_cache_the_family_has_no_hooks_for_is_refused_before_weights_load(toy_files, capsys, monkeypatch):
    """The toy family (tests/toy_family) declares First-Block-Cache, DBCache and TaylorSeer only (its
    model has ``cache_metric_stream`` and no MagCache or TeaCache hook): ``--cache magcache`` is refused
    in one line by generate's checks, before any device starts or weight loads."""
    from jaxdit import cli, generate

    monkeypatch.setattr(generate, "start_devices", lambda r: pytest.fail("devices started"))
    monkeypatch.setattr(generate, "build", lambda r, mesh: pytest.fail("weights loaded"))
    for name, title in (("magcache", "MagCache"), ("teacache", "TeaCache")):
        assert cli.main(test_toy_family._generate_argv(toy_files, "--cache", name)) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"jaxdit generate: error: {title} is not available for Toy DiT: the family provides the hooks "
            "of these caches only: dbcache, fbcache, taylorseer"
        ), err
