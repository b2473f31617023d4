"""jaxdit.runtime: the GPU XLA flags (added only where the user has not set them, only on GPU hosts, and
known to the installed XLA) and the persistent compilation cache (a second identical ``jaxdit
generate`` compiles nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxdit import runtime

ROOT = Path(__file__).resolve().parents[1]
LHS = "xla_gpu_enable_latency_hiding_scheduler"


def test_parse_xla_flags_reads_xla_syntax():
    flags = runtime.parse_xla_flags(" --a=1  --b --c=x=y -d=2 stray --a=3 ")
    assert flags == {"a": "3", "b": "true", "c": "x=y", "d": "2"}
    assert runtime.parse_xla_flags("") == {}


def test_flags_are_added_only_where_the_user_has_not_set_them():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    added, kept = runtime.add_xla_flags(env)
    assert [f.name for f in added] == [f.name for f in runtime.GPU_XLA_FLAGS] and kept == []
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 --{LHS}=true"
    assert runtime.add_xla_flags(env) == ([], [f"--{LHS}=true"])  # idempotent

    user = {"XLA_FLAGS": f"--{LHS}=false"}
    added, kept = runtime.add_xla_flags(user)
    assert added == [] and kept == [f"--{LHS}=false"] and user["XLA_FLAGS"] == f"--{LHS}=false"

    empty: dict[str, str] = {}
    runtime.add_xla_flags(empty)
    assert runtime.parse_xla_flags(empty["XLA_FLAGS"]) == {LHS: "true"}


def test_gpu_host_needs_a_gpu_plugin_and_platforms_that_allow_it(monkeypatch):
    monkeypatch.setattr(runtime, "gpu_plugins", lambda: ("xla_cuda12",))
    assert runtime.is_gpu_host({})
    assert runtime.is_gpu_host({"JAX_PLATFORMS": "cuda,cpu"})
    assert not runtime.is_gpu_host({"JAX_PLATFORMS": "cpu"})
    monkeypatch.setattr(runtime, "gpu_plugins", lambda: ())
    assert not runtime.is_gpu_host({})
    assert not runtime.is_gpu_host({"JAX_PLATFORMS": "cuda"})


def test_gpu_flags_are_known_to_the_installed_xla():
    """XLA aborts on an unknown name in XLA_FLAGS, and reads the variable when the backend starts: start
    one with jaxdit's GPU flags (the CPU client parses the same flag table as the GPU plugin)."""

    def start(flags: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        code = "import jax; print(len(jax.devices()))"
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    ours = start(" ".join(map(str, runtime.GPU_XLA_FLAGS)))
    assert ours.returncode == 0, ours.stderr[-2000:]
    bogus = start("--xla_gpu_no_such_flag_jaxdit=true")  # the check can fail
    assert bogus.returncode != 0 and "xla_gpu_no_such_flag_jaxdit" in bogus.stderr


def test_cache_directory_precedence(tmp_path):
    home = {"XDG_CACHE_HOME": str(tmp_path)}
    assert runtime.resolve_cache_dir(environ=home) == (tmp_path / "jaxdit" / "xla", "default")
    assert runtime.default_cache_dir({}) == Path.home() / ".cache" / "jaxdit" / "xla"
    env = dict(home, JAXDIT_COMPILATION_CACHE="/e", JAX_COMPILATION_CACHE_DIR="/j")
    assert runtime.resolve_cache_dir(environ=env)[0] == Path("/e")
    assert runtime.resolve_cache_dir("/f", environ=env)[0] == Path("/f")
    assert runtime.resolve_cache_dir("/f", disabled=True, environ=env) == (None, "--no_compilation_cache")
    assert runtime.resolve_cache_dir(environ=dict(home, JAX_COMPILATION_CACHE_DIR="/j"))[0] == Path("/j")
    for off in ("0", "off", "False", "no"):
        path, source = runtime.resolve_cache_dir(environ=dict(env, JAXDIT_COMPILATION_CACHE=off))
        assert path is None and source == f"JAXDIT_COMPILATION_CACHE={off}"


def test_verbose_lines_name_each_flag_and_the_cache(tmp_path):
    flag = runtime.GPU_XLA_FLAGS[0]
    lines = runtime.RuntimeSetup(True, [flag], [], tmp_path, "default").describe()
    assert lines[0].startswith(f"XLA flag added: --{LHS}=true (") and str(tmp_path) in lines[1]
    lines = runtime.RuntimeSetup(False, [], [], None, "--no_compilation_cache").describe()
    assert lines == [
        "XLA flags: none added (not a GPU host)",
        "compilation cache: off (--no_compilation_cache)",
    ]
    kept = runtime.RuntimeSetup(True, [], [f"--{LHS}=false"], None, "x").describe()
    assert f"XLA flag kept as the user set it: --{LHS}=false" in kept


def test_configure_leaves_a_process_whose_jax_has_started_alone():
    """A program that calls jaxdit.cli.main after using jax keeps its own XLA flags and cache settings."""
    jax.devices()
    env: dict[str, str] = {"XDG_CACHE_HOME": "/nonexistent"}
    before = jax.config.jax_compilation_cache_dir
    setup = runtime.configure(gpu=True, count_cache=True, environ=env)
    assert setup.too_late and env == {"XDG_CACHE_HOME": "/nonexistent"} and setup.counter is None
    assert jax.config.jax_compilation_cache_dir == before
    assert setup.describe() == [
        "XLA flags and compilation cache left as they were: jax had already started in this process"
    ]


def test_an_unwritable_cache_directory_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="compilation cache directory .*file/xla"):
        runtime.enable_compilation_cache(blocker / "xla")


def _generate(*flags: str, env: dict[str, str] | None = None) -> str:
    # One emulated device, two steps, the empty prompt (" ": no digit for the judge to check).
    cmd = [
        sys.executable,
        "-m",
        "jaxdit.cli",
        "generate",
        "--emulate_devices",
        "1",
        "--num_inference_steps",
        "2",
    ]
    cmd += ["--prompt", " ", "--verbose", *flags]
    environ = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    environ.pop("XLA_FLAGS", None)  # conftest's 8 devices: --emulate_devices sets its own
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _cache_counts(stdout: str) -> tuple[int, int, int]:
    m = re.search(r"compilation cache: (\d+) program\(s\) read, (\d+) compiled, (\d+) written", stdout)
    assert m, stdout
    return tuple(map(int, m.groups()))


def test_second_identical_generate_compiles_nothing(tmp_path):
    """The first run writes every program it compiles; the second (the cache named by the environment
    variable this time) reads them all and compiles none."""
    cache = tmp_path / "cache"
    out = tmp_path / "digits.png"
    first = _generate("--compilation_cache_dir", str(cache), "--output", str(out))
    assert f"compilation cache: {cache} (--compilation_cache_dir" in first
    assert "XLA flags: none added (not a GPU host)" in first
    read, compiled, written = _cache_counts(first)
    entries = [p for p in cache.iterdir() if not p.name.endswith("-atime")]
    assert read == 0 and compiled > 0 and written == compiled and len(entries) == written

    second = _generate("--output", str(out), env={"JAXDIT_COMPILATION_CACHE": str(cache)})
    assert f"compilation cache: {cache} ($JAXDIT_COMPILATION_CACHE" in second
    assert _cache_counts(second) == (compiled, 0, 0)


def test_generate_parses_the_runtime_flags():
    from jaxdit.cli import build_parser

    args = build_parser().parse_args(["generate", "--no-compilation-cache", "-v"])
    assert args.no_compilation_cache and args.verbose and args.compilation_cache_dir is None
    args = build_parser().parse_args(["generate", "--compilation_cache_dir", "/c"])
    assert args.compilation_cache_dir == "/c" and not args.no_compilation_cache and not args.verbose
