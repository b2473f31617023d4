"""Process-wide defaults the ``jaxdit`` command sets before jax starts: XLA flags on GPU hosts, and a
persistent compilation cache.

Both have to be in place before jax creates its backend: XLA reads ``XLA_FLAGS`` once, when the first
client starts (importing jax does not start it), and jax opens the compilation cache at the first
compile. :func:`configure` therefore runs before anything touches a device (after that it changes
nothing).

XLA flags. jaxdit adds only flags the user's ``XLA_FLAGS`` does not name (a flag the user set, to any
value, is left alone), and only on a GPU host: a jax GPU plugin is installed and ``JAX_PLATFORMS`` does
not exclude it (``--emulate_devices`` runs on CPU). Each flag's name was checked in the XLA that jax
ships: ``libjax_common.so`` of jaxlib 0.10.2 and 0.11.2 and ``xla_cuda_plugin.so`` of jax-cuda12-pjrt
0.11.2 (an unknown name in ``XLA_FLAGS`` aborts the process; ``tests/test_runtime.py`` starts jax with
them).

Compilation cache. jax's persistent cache (``jax_compilation_cache_dir``) keeps every compiled program
on disk, keyed by the program, the compile options, the devices and the jax/XLA versions, so a second
identical ``jaxdit generate`` reads its programs instead of compiling them. Where it lives, first match
wins: ``--no_compilation_cache``; ``--compilation_cache_dir DIR``; ``$JAXDIT_COMPILATION_CACHE`` (a
directory, or ``0``/``off`` to disable); jax's own ``JAX_COMPILATION_CACHE_DIR``; else
``$XDG_CACHE_HOME/jaxdit/xla`` (``~/.cache/jaxdit/xla``). The cache is never trimmed: delete the folder
to reclaim the space.
"""

from __future__ import annotations

import dataclasses
import os
import pkgutil
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class XlaFlag:
    """One XLA flag jaxdit sets on GPU hosts, and why."""

    name: str
    value: str
    why: str

    def __str__(self) -> str:
        return f"--{self.name}={self.value}"


#: The flags jaxdit adds to ``XLA_FLAGS`` on GPU hosts (each only if the user has not set it).
GPU_XLA_FLAGS: tuple[XlaFlag, ...] = (
    XlaFlag(
        "xla_gpu_enable_latency_hiding_scheduler",
        "true",
        "schedules asynchronous collectives around the compute that does not depend on them: Ring issues "
        "the next hop's K/V ppermute before the local block's attention (parallel/ring.py), and this "
        "scheduler is what moves the transfer's wait past that compute instead of right after the send. "
        "Off by default in XLA (xla/debug_options_flags.cc)",
    ),
)

#: Environment variable naming the cache directory, or 0/off/false/no to disable the cache.
CACHE_ENV = "JAXDIT_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "none")
#: Programs that compile faster than this are not written to the cache. jax's default (1 s) skips the
#: small programs a generation also compiles (noise, sampler updates, the VAE's pieces, text encoders on
#: short prompts); on a CPU most of tiny-digits' compiles are under a second, and a GPU compiles each of
#: those in tens to hundreds of ms, which adds up across a run. 0 keeps every program, so a second
#: identical run compiles nothing (``tests/test_runtime.py`` checks exactly that).
MIN_COMPILE_SECONDS = 0.0


# ----------------------------------------------------------------------------------------------------
# XLA flags


def parse_xla_flags(text: str) -> dict[str, str]:
    """``XLA_FLAGS`` as XLA reads it (whitespace-separated ``--name[=value]``) -> {name: value}.

    A bare ``--name`` is a boolean set to true; a later occurrence of a name overrides an earlier one.
    """
    flags: dict[str, str] = {}
    for token in text.split():
        if not token.startswith("-"):
            continue  # XLA rejects these itself; not ours to judge
        name, _, value = token.lstrip("-").partition("=")
        flags[name] = value if "=" in token else "true"
    return flags


def gpu_plugins() -> tuple[str, ...]:
    """jax's GPU PJRT plugins installed here (``jax_plugins.xla_cuda12``, ...), found without importing
    jax or the plugin (a plugin that is installed may still find no GPU: see :func:`is_gpu_host`)."""
    try:
        import jax_plugins  # the namespace package jax discovers plugins in
    except ImportError:
        return ()
    names = (m.name for m in pkgutil.iter_modules(jax_plugins.__path__))
    return tuple(sorted(n for n in names if n.startswith(("xla_cuda", "xla_rocm"))))


def is_gpu_host(environ: Mapping[str, str] | None = None) -> bool:
    """Whether jax will run on a GPU here: a GPU plugin is installed and ``JAX_PLATFORMS`` (if set)
    names cuda, rocm or gpu. Decided without starting jax."""
    environ = os.environ if environ is None else environ
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()]
    if platforms and not set(platforms) & {"cuda", "rocm", "gpu"}:
        return False
    return bool(gpu_plugins())


def add_xla_flags(
    environ: MutableMapping[str, str], flags: tuple[XlaFlag, ...] = GPU_XLA_FLAGS
) -> tuple[list[XlaFlag], list[str]]:
    """Append to ``environ["XLA_FLAGS"]`` each flag it does not name. Returns (flags added, the user's
    settings of our flags that were kept, as ``--name=value``)."""
    current = environ.get("XLA_FLAGS", "")
    user = parse_xla_flags(current)
    added = [f for f in flags if f.name not in user]
    kept = [f"--{f.name}={user[f.name]}" for f in flags if f.name in user]
    if added:
        environ["XLA_FLAGS"] = " ".join([current.strip(), *map(str, added)]).strip()
    return added, kept


# ----------------------------------------------------------------------------------------------------
# Compilation cache


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/jaxdit/xla``, or ``~/.cache/jaxdit/xla``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxdit" / "xla"


def resolve_cache_dir(
    flag_dir: str | None = None, disabled: bool = False, environ: Mapping[str, str] | None = None
) -> tuple[Path | None, str]:
    """(directory or None for off, where that came from), by the precedence in the module docstring."""
    environ = os.environ if environ is None else environ
    if disabled:
        return None, "--no_compilation_cache"
    if flag_dir:
        return Path(flag_dir).expanduser(), "--compilation_cache_dir"
    env = environ.get(CACHE_ENV, "").strip()
    if env.lower() in _OFF:
        return None, f"{CACHE_ENV}={env}"
    if env:
        return Path(env).expanduser(), f"${CACHE_ENV}"
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(environ["JAX_COMPILATION_CACHE_DIR"]).expanduser(), "$JAX_COMPILATION_CACHE_DIR"
    return default_cache_dir(environ), "default"


class CacheCounter:
    """Counts, from jax's monitoring events (public ``jax.monitoring`` listeners), the programs looked
    up in the persistent cache, those read from it, those written to it, and the compile time saved."""

    REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
    HIT = "/jax/compilation_cache/cache_hits"
    WRITE = "/jax/compilation_cache/cache_misses"  # jax records it when it writes an entry
    SAVED = "/jax/compilation_cache/compile_time_saved_sec"

    def __init__(self) -> None:
        self.requests = self.hits = self.writes = 0
        self.saved_seconds = 0.0

    @property
    def compiled(self) -> int:
        return self.requests - self.hits

    def install(self) -> CacheCounter:
        import jax

        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def _event(self, event: str, **_) -> None:
        if event == self.REQUEST:
            self.requests += 1
        elif event == self.HIT:
            self.hits += 1
        elif event == self.WRITE:
            self.writes += 1

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event == self.SAVED:
            self.saved_seconds += seconds

    def describe(self) -> str:
        return (
            f"compilation cache: {self.hits} program(s) read, {self.compiled} compiled, {self.writes} "
            f"written ({self.saved_seconds:.1f} s of compilation saved)"
        )


def enable_compilation_cache(path: Path, min_compile_seconds: float = MIN_COMPILE_SECONDS) -> None:
    """Point jax's persistent cache at ``path`` (created if missing) before the first compile."""
    import jax

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"compilation cache directory {path}: {e.strerror}; pass --compilation_cache_dir DIR, set "
            f"{CACHE_ENV}=DIR, or turn it off with --no_compilation_cache / {CACHE_ENV}=0"
        ) from e
    if not os.access(path, os.W_OK):
        raise ValueError(
            f"compilation cache directory {path} is not writable; pass --compilation_cache_dir DIR or "
            f"--no_compilation_cache"
        )
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # the user's jax setting wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)


# ----------------------------------------------------------------------------------------------------
# Both, for the command line


@dataclasses.dataclass
class RuntimeSetup:
    """What :func:`configure` did, for ``--verbose``."""

    gpu_host: bool
    xla_flags_added: list[XlaFlag]
    xla_flags_kept: list[str]
    cache_dir: Path | None
    cache_source: str
    counter: CacheCounter | None = None
    too_late: bool = False  # jax had started before configure(): nothing was changed

    def describe(self) -> list[str]:
        if self.too_late:
            return [
                "XLA flags and compilation cache left as they were: jax had already started in this process"
            ]
        lines = []
        if not self.gpu_host:
            lines.append("XLA flags: none added (not a GPU host)")
        for f in self.xla_flags_added:
            lines.append(f"XLA flag added: {f} ({f.why})")
        for f in self.xla_flags_kept:
            lines.append(f"XLA flag kept as the user set it: {f}")
        if self.cache_dir is None:
            lines.append(f"compilation cache: off ({self.cache_source})")
        else:
            import jax

            least = jax.config.jax_persistent_cache_min_compile_time_secs
            lines.append(
                f"compilation cache: {self.cache_dir} ({self.cache_source}; programs compiling in >= "
                f"{least:g} s are kept)"
            )
        return lines


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public query; only asked, never relied on for results

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())


def configure(
    *,
    cache_dir: str | None = None,
    no_cache: bool = False,
    gpu: bool | None = None,
    count_cache: bool = False,
    environ: MutableMapping[str, str] | None = None,
) -> RuntimeSetup:
    """Set the GPU XLA flags (if ``gpu``, default :func:`is_gpu_host`) and the compilation cache.

    Takes effect only before jax starts its backend. In a process where jax has already started (a
    program calling ``jaxdit.cli.main`` after using jax itself) it changes nothing, so that the program's
    own settings hold for the rest of it, and says so in :meth:`RuntimeSetup.describe`. ``count_cache``
    installs a :class:`CacheCounter` (for ``--verbose``).
    """
    environ = os.environ if environ is None else environ
    gpu = is_gpu_host(environ) if gpu is None else gpu
    if _backend_started():
        return RuntimeSetup(gpu, [], [], None, "unchanged", too_late=True)
    added, kept = add_xla_flags(environ) if gpu else ([], [])
    path, source = resolve_cache_dir(cache_dir, no_cache, environ)
    if path is not None:
        enable_compilation_cache(path)
    counter = CacheCounter().install() if count_cache and path is not None else None
    return RuntimeSetup(gpu, added, kept, path, source, counter)


#: More emulated devices than this is a mistake, not a test: each is a thread pool and a share of memory.
MAX_EMULATED_DEVICES = 256


def check_emulated_devices(count: int) -> None:
    """Raise ValueError unless ``count`` is a sane number of emulated CPU devices (1..256)."""
    if not 1 <= count <= MAX_EMULATED_DEVICES:
        raise ValueError(
            f"--emulate_devices must be in 1..{MAX_EMULATED_DEVICES} (CPU devices emulated in one process), "
            f"got {count}"
        )


def emulate_cpu_devices(count: int) -> None:
    """Run on ``count`` emulated CPU devices (``--emulate_devices``).

    jax fixes its device count when its backend starts. In a process where it has already started (a
    program calling ``jaxdit.cli.main`` after using jax itself), the devices it has are used if they are
    CPU devices and enough of them; otherwise a ValueError says what to do, instead of jax's internal
    error.
    """
    import jax

    check_emulated_devices(count)
    if not _backend_started():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
        return
    devices = jax.devices()
    if devices[0].platform != "cpu" or len(devices) < count:
        raise ValueError(
            f"--emulate_devices {count}: jax has already started in this process with {len(devices)} "
            f"{devices[0].platform} device(s), and its device count cannot change now; run in a fresh "
            f"process, or set XLA_FLAGS=--xla_force_host_platform_device_count={count} before jax starts"
        )
