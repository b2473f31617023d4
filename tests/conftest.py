"""Tests run on 8 emulated CPU devices; the flag must be set before jax is imported anywhere."""

import os
import shutil
import tempfile

# Once: pytest-xdist's workers inherit the variable from the process that started them.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# The suite's programs are tiny and each runs a few times, so LLVM's optimisation of the generated CPU
# code costs more than it saves: level 0 cuts the CPU time of compile-bound files by 15-40%. It changes
# how XLA's CPU backend emits code, not the HLO passes, so compiled memory and the collectives the
# tests count are the same. Subprocesses inherit it; a test that wants a user's flags drops XLA_FLAGS.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, made by the first process (pytest-xdist's
# controller) and inherited by its workers and by the `jaxdit` subprocesses tests start: the suite
# compiles the same tiny programs in many tests and processes (every CLI test of a family builds the
# model a test of its pipeline already compiled), and each is then compiled once. It is a fresh directory
# per run, removed at the end, so nothing leaks into ~/.cache and no run reads another's programs; tests
# of the cache itself pass a directory of their own. JAXDIT_TEST_COMPILATION_CACHE=0 turns it off.
_TEST_CACHE = "JAXDIT_TEST_COMPILATION_CACHE"
if _TEST_CACHE not in os.environ:
    os.environ[_TEST_CACHE] = tempfile.mkdtemp(prefix="jaxdit-test-xla-")
    _OWN_CACHE_DIR = os.environ[_TEST_CACHE]
else:
    _OWN_CACHE_DIR = None
os.environ.setdefault("JAXDIT_COMPILATION_CACHE", os.environ[_TEST_CACHE])

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
if os.environ[_TEST_CACHE] not in ("0", "off"):
    jax.config.update("jax_compilation_cache_dir", os.environ[_TEST_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)
