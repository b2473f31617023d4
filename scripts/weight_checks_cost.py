"""What the load-time weight checks (converters/checks.py) cost: at full size, per GiB, on the tiny models.

    python scripts/weight_checks_cost.py full      # flux-dev, wan2.1-t2v-14b: compiled FLOPs, bytes, temp
    python scripts/weight_checks_cost.py per-gib   # a 512 MiB bf16 stack: checks vs orbax's own read
    python scripts/weight_checks_cost.py tiny      # the tests' tiny models: host and device paths

``full`` compiles from abstract shapes (nothing allocated): the finiteness program on one device and on a
tensor=8 mesh (8 emulated devices; bytes are per device), and the checksum's per-layer programs (FLOPs and
bytes summed over every array and layer). ``per-gib`` writes a 512 MiB checkpoint under /tmp and reads it
back with and without verification; it prints wall seconds and process CPU seconds (on a shared machine
the latter is the steadier number).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import glob  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from converters import checks, orbax_io  # noqa: E402


def _cost(compiled) -> tuple[float, float, int]:
    ca, ma = compiled.cost_analysis(), compiled.memory_analysis()
    return ca.get("flops", 0.0), ca.get("bytes accessed", 0.0), ma.temp_size_in_bytes


def full() -> None:
    from jaxdit.mesh import ParallelConfig
    from jaxdit.models import flux, wan
    from jaxdit.models.partitioning import named_shardings
    from sharding_rules import rules_for

    models = [
        ("flux-dev", flux.FluxConfig.preset("flux-dev"), flux.abstract_model),
        ("wan2.1-t2v-14b", wan.WanConfig.preset("wan2.1-t2v-14b"), wan.abstract_model),
    ]
    for name, cfg, make in models:
        _, abstract = nnx.split(make(cfg, jnp.bfloat16))
        flat = nnx.to_flat_state(abstract)
        leaves = [jax.ShapeDtypeStruct(v.shape, v.dtype) for _, v in flat]
        size = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)
        print(f"{name}: {len(leaves)} arrays, {size / 2**30:.2f} GiB bf16")
        t = time.process_time()
        flops, nbytes, temp = _cost(checks._finite_on_one_device().lower(leaves).compile())
        print(f"  finite, one device: {flops:.3g} FLOPs, {nbytes / 2**30:.2f} GiB read, temp {temp / 2**20:.1f} MiB, "
              f"compile {time.process_time() - t:.2f} cpu-s")  # fmt: skip
        mesh = ParallelConfig(tensor=8).make_mesh(jax.devices()[:8])
        shardings = [
            s.get_value() for _, s in nnx.to_flat_state(named_shardings(abstract, rules_for(tensor=8), mesh))
        ]
        targets = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings, strict=True)
        ]
        t = time.process_time()
        program = checks._finite_on_mesh(mesh, tuple(s.spec for s in shardings))
        flops, nbytes, temp = _cost(program.lower(*targets).compile())
        print(f"  finite, tensor=8 (per device): {flops:.3g} FLOPs, {nbytes / 2**30:.2f} GiB read, temp "
              f"{temp / 2**20:.1f} MiB, compile {time.process_time() - t:.2f} cpu-s")  # fmt: skip
        total, largest, programs, t = np.zeros(2), 0, {}, time.process_time()
        for x in leaves:
            shape, layers = (x.shape[1:], x.shape[0]) if len(x.shape) >= 3 else (x.shape, 1)
            if shape not in programs:
                u32 = jax.ShapeDtypeStruct((len(shape),), jnp.uint32)
                block = jax.ShapeDtypeStruct(shape, x.dtype)
                scalar = jax.ShapeDtypeStruct((), jnp.uint32)
                programs[shape] = (
                    checks._device_checksum_program().lower(block, scalar, u32, u32, "bfloat16").compile()
                )
            flops, nbytes, temp = _cost(programs[shape])
            total += layers * np.array([flops, nbytes])
            largest = max(largest, temp)
        print(f"  checksum, one device: {len(programs)} programs, {total[0]:.3g} FLOPs, {total[1] / 2**30:.2f} GiB "
              f"accessed, largest temp {largest / 2**20:.0f} MiB, compile {time.process_time() - t:.2f} cpu-s")  # fmt: skip


def _best(fn, repeats: int = 3) -> tuple[float, float]:
    fn()  # compile, warm caches
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(runs)


def per_gib() -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4096, 8192), dtype=np.float32)).astype(
        jnp.bfloat16
    )
    gib = x.nbytes / 2**30
    for label, fn in [
        ("finite (device program)", lambda: checks._device_finite([x])),
        ("checksum (device, per layer)", lambda: checks.checksum(x, jnp.bfloat16)),
    ]:
        wall, cpu = _best(fn)
        print(f"{label}: {gib / wall:.2f} GiB/s wall, {cpu / gib:.2f} cpu-s/GiB")
    folder = tempfile.mkdtemp(prefix="weight-checks-")
    try:
        ckpt = orbax_io.save(
            f"{folder}/ckpt", {"w": x}, {"family": "flux", "dtype": "bfloat16", "config": {}}
        )
        target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)}
        for verify in (False, True):
            wall, cpu = _best(
                lambda v=verify: jax.block_until_ready(orbax_io.restore(ckpt, target, verify=v))
            )
            print(f"orbax restore, verify={verify}: {gib / wall:.2f} GiB/s wall, {cpu / gib:.2f} cpu-s/GiB")
        data = max(glob.glob(f"{ckpt}/params/**/d/*", recursive=True), key=os.path.getsize)
        dd = ["dd", f"if={data}", "of=/dev/null", "bs=16M", "iflag=direct"]
        print(
            "disk read, uncached (dd iflag=direct):",
            subprocess.run(dd, capture_output=True, text=True).stderr.split("\n")[-2],
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tiny() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import flux_tiny
    import wan_tiny

    from jaxdit.loading import load_params
    from jaxdit.mesh import ParallelConfig, single_device_mesh

    for name, folder in [
        ("flux tiny", flux_tiny.diffusers_folder(True)),
        ("wan tiny", wan_tiny.diffusers_folder(False)),
    ]:
        for mesh_name, mesh in [("1 device", single_device_mesh()), ("tensor=4 x ulysses=2", ParallelConfig(tensor=4, ulysses=2).make_mesh())]:  # fmt: skip
            _, model = load_params(folder, mesh)
            arrays = {
                ".".join(map(str, p)): v.get_value()
                for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
            }
            for path, limit in [("host", 1 << 30), ("device", 0)]:
                checks.HOST_CHECK_MAX_BYTES = limit
                stored = {n: a.dtype for n, a in arrays.items()}
                times = []
                for what, kwargs in [("finite", {}), ("finite+checksum", {"stored_dtypes": stored})]:
                    for run in ("first", "warm"):
                        wall, cpu = time.perf_counter(), time.process_time()
                        checks.scan(arrays, **kwargs)
                        times.append(
                            f"{what} {run} {time.perf_counter() - wall:.2f} s ({time.process_time() - cpu:.2f} cpu-s)"
                        )
                print(f"{name}, {mesh_name}, {path}: " + "; ".join(times))


if __name__ == "__main__":
    {"full": full, "per-gib": per_gib, "tiny": tiny}[sys.argv[1] if len(sys.argv) > 1 else "full"]()
