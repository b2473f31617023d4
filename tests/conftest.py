"""Tests run on 8 emulated CPU devices; the flag must be set before jax is imported anywhere."""

import os

# Once: pytest-xdist's workers inherit the variable from the process that started them.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `jaxdit generate` called in-process keeps no compiled programs in ~/.cache (tests that want the cache
# pass a directory of their own).
os.environ.setdefault("JAXDIT_COMPILATION_CACHE", "0")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
