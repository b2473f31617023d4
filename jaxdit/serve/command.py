"""``jaxdit serve``: its flags and what it runs (jaxdit/cli.py only dispatches here).

jaxdit serve [--weights PIPELINE_FOLDER] [mesh flags] [--sizes 1024x1024,768x1344] --host 127.0.0.1 --port 8000

Start-up, in order: every flag is checked (no jax yet); the devices start (emulated CPU devices, the
persistent compilation cache, the process group); the model loads once; every served shape (``--sizes`` x
``--batch_sizes`` x ``--frames`` x ``--step_counts``) is run once, which compiles its programs; then process 0 listens for
HTTP and the other processes follow it (:mod:`jaxdit.serve.lockstep`). On SIGINT / SIGTERM the server
stops taking requests, answers the queued ones (503), lets the running one finish within
``--shutdown_grace`` seconds, and ends the other processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from jaxdit import distributed, runtime

__all__ = ["Service", "add_arguments", "run"]

_SIZE = re.compile(r"^(\d+)x(\d+)$")


def _flag(parser, name: str, **kwargs) -> None:
    """``--name_with_underscores`` and its ``--hyphenated-spelling`` (as jaxdit generate's flags)."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, dest=name, **kwargs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    _flag(p, "weights", default=None, help="a pipeline folder of a registered family (diffusers layout, "
          "or the family's own release layout); default: the bundled {bundled}")  # fmt: skip
    _flag(p, "model_name", default=None, help="the name clients send as `model` (default: the bundled "
          "model's or the folder's name)")  # fmt: skip
    _flag(p, "dtype", choices=("float32", "bfloat16", "float16"), default=None)
    _flag(p, "host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    _flag(p, "port", type=int, default=8000)
    _flag(
        p, "sizes", default=None, help="WIDTHxHEIGHT[,...] compiled at start-up (default: the model's size)"
    )
    _flag(p, "batch_sizes", default="1", help="images per request (n) compiled at start-up (default 1)")
    _flag(p, "frames", default=None, help="videos: frame counts compiled at start-up (default the model's)")
    _flag(p, "step_counts", default=None, help="denoising step counts compiled at start-up (the step count "
          "is part of the compiled step; default the model's)")  # fmt: skip
    _flag(p, "new_shapes", choices=("refuse", "compile"), default="refuse", help="a request for a shape "
          "not compiled at start-up is refused (400, default) or compiled once and then served")  # fmt: skip
    _flag(p, "max_queue", type=int, default=16, help="requests waiting beyond the running one (then 429)")
    _flag(p, "request_timeout", type=float, default=600.0, help="seconds from arrival to answer (then 504)")
    _flag(p, "shutdown_grace", type=float, default=30.0, help="seconds the running request may finish in "
          "at shutdown")  # fmt: skip
    _flag(p, "max_steps", type=int, default=100)
    _flag(p, "max_batch", type=int, default=4, help="largest n")
    _flag(p, "max_prompt_chars", type=int, default=2000)
    _flag(p, "max_images", type=int, default=3, help="input pictures per request, for models that take "
          "them (Qwen-Image-Edit, FLUX.2, FLUX.1 Kontext; fewer where the model takes fewer)")  # fmt: skip
    _flag(p, "max_image_pixels", type=int, default=4096 * 4096, help="the largest input picture, in pixels")
    _flag(p, "image_sizes", default=None, help="input pictures of the start-up requests, for models that "
          "take them: WxH[+WxH...] per request, comma-separated (default: as many as the model needs, "
          "of each output size)")  # fmt: skip
    _flag(p, "max_body_bytes", type=int, default=None, help="the largest request body (then 413; default "
          "1 MiB, 32 MiB for a model that takes pictures: they come base64-encoded)")  # fmt: skip
    _flag(p, "compilation_cache_dir", default=None, help="keep compiled programs here, so a restart loads "
          "them (default: $JAXDIT_COMPILATION_CACHE, else ~/.cache/jaxdit/xla)")  # fmt: skip
    _flag(p, "no_compilation_cache", action="store_true", help="compile everything afresh, keep nothing")
    _flag(p, "emulate_devices", type=int, default=None, help="emulate N CPU devices per process")
    _flag(
        p,
        "quantize",
        choices=("fp8",),
        default=None,
        help="fp8: the transformer blocks' linear weights "
        "in float8_e4m3fn, as `jaxdit generate --quantize fp8`",
    )
    _flag(
        p,
        "fp8_mode",
        choices=("weight", "matmul"),
        default=None,
        help="with --quantize fp8: as `jaxdit generate --fp8_mode`",
    )
    _flag(
        p,
        "fp8_skip_steps",
        type=int,
        default=0,
        metavar="N",
        help="with --quantize fp8: the first and last N steps of every request with the original weights, "
        "as `jaxdit generate --fp8_skip_steps` (a request of fewer than 2N steps is refused)",
    )
    _flag(
        p,
        "fp8_keep",
        default=None,
        metavar="LAYERS",
        help="with --quantize fp8: the block layers left in --dtype, as `jaxdit generate --fp8_keep`",
    )
    _flag(
        p,
        "offload_encoders",
        action="store_true",
        help="keep the text encoders' weights in host memory "
        "between requests (copied to the device per prompt)",
    )
    _flag(p, "caches", default=None, help="feature caches a request may name as `cache` (comma-separated: "
          "fbcache, teacache, magcache, taylorseer, dbcache); each is compiled at start-up at its default "
          "threshold (default: none)")  # fmt: skip
    _flag(p, "log_level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    par = p.add_argument_group("parallelism (xDiT's flags)")
    _flag(par, "data_parallel_degree", type=int, default=1)
    _flag(par, "use_cfg_parallel", action="store_true", help="split the CFG branches over 2 devices")
    _flag(par, "ulysses_degree", type=int, default=1)
    _flag(par, "ring_degree", type=int, default=1)
    _flag(par, "tensor_parallel_degree", type=int, default=1)
    _flag(par, "pipefusion_parallel_degree", type=int, default=1, help="PipeFusion stages (FLUX, Wan); "
          "progress and cancellation then act after each warm-up step and at the end of the pipelined "
          "phase (one program for all its steps), and each step count is a shape of its own")  # fmt: skip
    _flag(par, "num_pipeline_patch", type=int, default=None, help="PipeFusion patches M >= P (as jaxdit "
          "generate's)")  # fmt: skip
    _flag(par, "warmup_steps", type=int, default=None, help="PipeFusion's synchronous first steps "
          "(default 1)")  # fmt: skip
    distributed.add_arguments(p)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The checked flags."""

    config: Any  # ParallelConfig
    group: distributed.ProcessGroup | None
    sizes: tuple[tuple[int, int], ...] | None
    batch_sizes: tuple[int, ...]
    frames: tuple[int, ...] | None
    step_counts: tuple[int, ...] | None
    caches: tuple[str, ...] = ()
    #: Per start-up request, its input pictures' (width, height); None: the engine's default.
    image_sizes: tuple[tuple[tuple[int, int], ...], ...] | None = None


def _picture_sets(text: str | None, template, max_images: int) -> tuple | None:
    """``--image_sizes``: per start-up request a set of picture sizes, as many as the model takes."""
    from jaxdit.serve.engine import image_counts

    if text is None:
        return None
    least, most = image_counts(template.family, template.folder, max_images)
    if not most:
        raise ValueError(f"--image_sizes: {template.label} takes no input pictures")
    sets = []
    for entry in text.split(","):
        sizes = []
        for part in entry.split("+"):
            m = _SIZE.match(part.strip())
            if not m or min(int(m[1]), int(m[2])) < 1:
                raise ValueError(
                    f"--image_sizes takes WxH[+WxH...][,...] (e.g. 1024x768+512x512), got {part!r}"
                )
            sizes.append((int(m[1]), int(m[2])))
            problem = template.family.picture_problem(template.folder, *sizes[-1])
            if problem:
                raise ValueError(f"--image_sizes {part.strip()}: {template.label} cannot edit it: {problem}")
        if not least <= len(sizes) <= most:
            raise ValueError(
                f"--image_sizes {entry.strip()!r}: {template.label} takes {least} to {most} pictures, "
                f"got {len(sizes)}"
            )
        sets.append(tuple(sizes))
    return tuple(sets)


def _numbers(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{flag} takes positive integers, got {text!r}")
    return values


def check(args: argparse.Namespace) -> _Plan:
    """Every flag, before jax starts; ValueError naming the problem."""
    from jaxdit.mesh import ParallelConfig

    missing = [
        m for m in ("starlette", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ValueError(f"jaxdit serve needs {', '.join(missing)}: pip install 'jaxdit[serve]'")

    config = ParallelConfig(
        data=args.data_parallel_degree,
        cfg=2 if args.use_cfg_parallel else 1,
        pipefusion=args.pipefusion_parallel_degree,
        ring=args.ring_degree,
        ulysses=args.ulysses_degree,
        tensor=args.tensor_parallel_degree,
    )
    group = distributed.resolve(args.coordinator, args.num_processes, args.process_id)
    if args.emulate_devices is not None:
        runtime.check_emulated_devices(args.emulate_devices)
        config.validate_devices(args.emulate_devices * ((group.num_processes or 1) if group else 1))
    if not 0 <= args.port <= 65535:  # 0: any free port
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if group is None or group.process_id == 0:  # process 0 alone listens
        check_listen(args.host, args.port)
    sizes = None
    if args.sizes is not None:
        sizes = []
        for text in args.sizes.split(","):
            m = _SIZE.match(text.strip())
            if not m:
                raise ValueError(f"--sizes takes WIDTHxHEIGHT[,...] (e.g. 1024x768), got {text!r}")
            sizes.append((int(m[1]), int(m[2])))
        sizes = tuple(sizes)
    for name in ("max_steps", "max_batch", "max_prompt_chars", "max_images", "max_image_pixels"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1024:
        raise ValueError(f"--max_body_bytes must be >= 1024, got {args.max_body_bytes}")
    if args.max_queue < 0:
        raise ValueError(f"--max_queue must be >= 0, got {args.max_queue}")
    for name, low in (("request_timeout", 0.0), ("initialization_timeout", 0.0), ("shutdown_grace", None)):
        value = getattr(args, name)
        if not math.isfinite(value) or (value <= low if low is not None else value < 0):
            bound = "> 0" if low is not None else ">= 0"
            raise ValueError(f"--{name} must be a finite number of seconds {bound}, got {value}")
    batch_sizes = _numbers(args.batch_sizes, "batch_sizes")
    if max(batch_sizes) > args.max_batch:
        raise ValueError(f"--batch_sizes {args.batch_sizes} exceeds --max_batch {args.max_batch}")
    frames = _numbers(args.frames, "frames") if args.frames is not None else None
    step_counts = _numbers(args.step_counts, "step_counts") if args.step_counts is not None else None
    if step_counts is not None and max(step_counts) > args.max_steps:
        raise ValueError(f"--step_counts {args.step_counts} exceeds --max_steps {args.max_steps}")
    from jaxdit.serve.engine import Engine

    template = Engine.template_for(  # what cannot be served, refused now
        args.weights,
        config,
        args.dtype,
        warmup_steps=args.warmup_steps,
        num_pipeline_patch=args.num_pipeline_patch,
        quantize=args.quantize,
        fp8_mode=args.fp8_mode,
        fp8_skip_steps=args.fp8_skip_steps,
        fp8_keep=args.fp8_keep,
        offload_encoders=args.offload_encoders,
    )
    if frames is not None and not template.family.makes_video:
        raise ValueError(f"--frames applies to video models; {template.label} makes images")
    if template.family.makes_video and importlib.util.find_spec("av") is None:
        raise ValueError("serving videos (MP4) needs PyAV: pip install 'jaxdit[video]'")
    from jaxdit.serve.engine import image_counts

    pictures = _picture_sets(args.image_sizes, template, args.max_images)
    least = image_counts(template.family, template.folder, args.max_images)[0]
    probes = _probe_pictures(pictures, least)
    _check_shapes(template, sizes, frames, step_counts, probes, output_sized=0 if pictures else least)
    caches = _caches(args.caches, template, probes[0])
    return _Plan(config, group, sizes, batch_sizes, frames, step_counts, caches, pictures)


def _caches(text: str | None, template, image: Any = None) -> tuple[str, ...]:
    """``--caches``: known names the model and the mesh take (as `jaxdit generate --cache` checks them);
    ``image``: a start-up request's input pictures (a model that needs them)."""
    from jaxdit.cache import CACHES
    from jaxdit.generate_checks import check_request

    if text is None:
        return ()
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in CACHES]
    if not names or unknown:
        raise ValueError(
            f"--caches {text!r}: {', '.join(unknown) or 'empty'}; the caches are {', '.join(sorted(CACHES))}"
        )
    # On a PipeFusion mesh the check below refuses the caches that decide from the data (PipeFusion
    # takes the host-planned MagCache and TaylorSeer only) and the families whose runner takes none.
    probe = dataclasses.replace(template, prompt=template.family.example_prompt, image=image)
    for name in names:
        try:
            check_request(dataclasses.replace(probe, feature_cache=name), output=False)
        except ValueError as e:
            raise ValueError(f"cannot serve --caches {name}: {e}") from None
    return names


def _check_shapes(template, sizes, frames, step_counts, pictures=(None,), output_sized: int = 0) -> None:
    """The start-up shapes as `jaxdit generate` checks them (sizes, frames, steps against the model and the
    mesh: PipeFusion's patches and warm-up steps among them), before anything loads. ``pictures``: the
    start-up requests' input pictures (``--image`` of the check: grey pixels, as the warm-up sends);
    ``output_sized``: without ``--image_sizes`` the warm-up sends that many pictures of each output size
    (a model whose picture decides the size drawn checks the size against them), and so does the check."""
    probe = dataclasses.replace(template, prompt=template.family.example_prompt)
    for width, height in sizes or ((None, None),):
        images = pictures
        if output_sized and width is not None:
            images = _probe_pictures((((width, height),) * output_sized,), output_sized)
        for num_frames in frames or (None,):
            for steps in step_counts or (None,):
                for image in images:
                    _check_shape(
                        dataclasses.replace(
                            probe,
                            width=width,
                            height=height,
                            num_frames=num_frames,
                            num_inference_steps=steps,
                            image=image,
                        )
                    )


def _probe_pictures(picture_sets, least: int) -> tuple:
    """``--image`` values for the checks: one per start-up picture set (None: ``least`` small ones)."""
    grey = lambda w, h: np.full((h, w, 3), 128, np.uint8)  # noqa: E731
    sets = picture_sets or (((8, 8),) * least,)
    values = tuple(tuple(grey(w, h) for w, h in s) for s in sets)
    return tuple(None if not v else v[0] if len(v) == 1 else v for v in values)


def _check_shape(shape) -> None:
    from jaxdit.generate_checks import check_request

    try:
        check_request(shape, output=False)
    except ValueError as e:
        raise ValueError(f"cannot serve the start-up shapes: {e}") from None


def check_listen(host: str, port: int) -> None:
    """The address can be listened at, found before the model loads and compiles (minutes), not after:
    a host that is not this machine's, or a port in use, is named with its flag."""

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--host {host!r} is not an address to listen at ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port} is in use at {host}; give another --port") from None
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def start_devices(args: argparse.Namespace, plan: _Plan) -> None:
    """XLA flags and the compilation cache (``jaxdit.runtime``), emulated devices, the process group:
    before anything touches a device."""
    runtime.configure(
        cache_dir=args.compilation_cache_dir,
        no_cache=args.no_compilation_cache,
        gpu=False if args.emulate_devices else None,  # emulated devices run on the CPU
    )
    if args.emulate_devices:
        runtime.emulate_cpu_devices(args.emulate_devices)
    if plan.group is not None:
        # Every process serves the same model on the same mesh; only who it is, where it listens and how
        # long it waits may differ.
        own = {"coordinator", "num_processes", "process_id", "initialization_timeout", "host", "port", "func"}
        agreement = {k: v for k, v in sorted(vars(args).items()) if k not in own}
        distributed.join(
            plan.group, initialization_timeout_seconds=args.initialization_timeout, agreement=agreement
        )


def load(args: argparse.Namespace, plan: _Plan):
    """The engine on its mesh, with every served shape compiled; returns (engine, seconds, programs)."""
    import jax

    from jaxdit.serve.engine import Engine, EngineLimits
    from jaxdit.serve.metrics import compile_counts, listen_for_compiles
    from jaxdit.serve.schema import RequestError

    listen_for_compiles()
    start = time.perf_counter()
    devices = jax.devices()
    if len(devices) < plan.config.num_devices:
        raise ValueError(
            f"{plan.config.describe()} needs {plan.config.num_devices} devices; {len(devices)} are available"
        )
    mesh = plan.config.device_mesh(devices[: plan.config.num_devices])  # the mesh and its degrees
    limits = EngineLimits(
        max_steps=args.max_steps,
        max_batch=args.max_batch,
        max_prompt_chars=args.max_prompt_chars,
        max_images=args.max_images,
        max_image_pixels=args.max_image_pixels,
        max_body_bytes=args.max_body_bytes,
    )
    engine = Engine.load(
        args.weights,
        mesh,
        dtype=args.dtype,
        limits=limits,
        name=args.model_name,
        warmup_steps=args.warmup_steps,
        num_pipeline_patch=args.num_pipeline_patch,
        quantize=args.quantize,
        fp8_mode=args.fp8_mode,
        fp8_skip_steps=args.fp8_skip_steps,
        fp8_keep=args.fp8_keep,
        offload_encoders=args.offload_encoders,
        caches=plan.caches,
    )
    card = engine.card
    sizes = plan.sizes or (card.default_size,)
    frames = plan.frames or ((card.default_frames,) if card.default_frames else (None,))
    steps = plan.step_counts or (card.default_steps,)
    warm = [
        engine.request_for(w, h, n, f, k, c, pictures=p)
        for (w, h) in sizes
        for n in plan.batch_sizes
        for f in frames
        for k in steps
        for c in (None, *plan.caches)
        for p in plan.image_sizes or (None,)
    ]
    try:
        engine.warm_up(warm)
    except RequestError as e:
        raise ValueError(f"cannot serve the start-up shapes: {e.message}") from None
    return engine, time.perf_counter() - start, compile_counts()


def _server(config, scheduler):
    """uvicorn's server, told to shut the scheduler down when a signal arrives (uvicorn is optional, so
    the subclass is made here)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            scheduler.begin_shutdown()  # answer the queue now; uvicorn then waits for those answers
            # As uvicorn's own, but without re-raising the signal once the server has stopped: that
            # would end the process before the other processes are told to stop.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return Server(config)


class Service:
    """A running HTTP server over a scheduler, in a thread (tests, notebooks); :meth:`stop` shuts it down
    as a signal would."""

    def __init__(
        self, scheduler, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **app_options
    ) -> None:
        import uvicorn

        from jaxdit.serve.app import create_app

        self.scheduler = scheduler
        config = uvicorn.Config(
            create_app(scheduler, **app_options), host=host, port=port, log_level=log_level, lifespan="off"
        )
        self.server = _server(config, scheduler)
        scheduler.start()
        self._thread = threading.Thread(target=self.server.run, name="jaxdit-http", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start (is the port taken?)")
            time.sleep(0.01)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self, timeout: float = 30.0) -> None:
        self.scheduler.begin_shutdown()
        self.server.should_exit = True
        self._thread.join(timeout)
        self.scheduler.close(timeout)


def run(args: argparse.Namespace) -> int:
    plan = check(args)
    start_devices(args, plan)
    import jax

    from jaxdit.serve import lockstep

    engine, seconds, (compiled, cached) = load(args, plan)
    card = engine.card
    processes = jax.process_count()
    shapes = "; ".join(engine.describe(k) for k in sorted(engine.compiled))
    say = lambda line: print(f"jaxdit serve: {line}", file=sys.stderr, flush=True)
    say(
        f"{card.name} ({card.kind}s) on {plan.config.describe()}, {plan.config.num_devices} "
        f"{jax.devices()[0].platform} device(s) in {processes} process(es); ready in {seconds:.1f} s "
        f"({compiled} programs compiled, {cached} from the cache); shapes: {shapes}"
    )
    if jax.process_index() != 0:
        served = lockstep.follow(engine, distributed.key_value_store(), jax.process_index())
        say(f"process {jax.process_index()}: process 0 stopped after {served} request(s)")
        return 0

    import uvicorn

    from jaxdit.serve.app import create_app
    from jaxdit.serve.jobs import Scheduler
    from jaxdit.serve.metrics import Metrics

    leader = lockstep.Leader(distributed.key_value_store(), processes) if processes > 1 else None
    scheduler = Scheduler(
        engine,
        Metrics(),
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        new_shapes=args.new_shapes,
        shutdown_grace=args.shutdown_grace,
        lockstep=leader,
    )
    scheduler.start()
    config = uvicorn.Config(
        create_app(scheduler),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
        timeout_graceful_shutdown=args.shutdown_grace + 5,
    )
    try:
        _server(config, scheduler).run()
    finally:
        scheduler.close(args.shutdown_grace + 5)
    lost = scheduler.lost_processes()
    if lost:
        # jax's exit waits at a shutdown barrier for every process, a dead one included, until its
        # heartbeat timeout ends this one with a fatal error and a C++ stack: leave at once instead.
        say(f"stopped (process(es) {', '.join(map(str, lost))} had stopped answering)")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    say("stopped")
    return 0
