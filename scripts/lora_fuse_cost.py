"""What fusing a LoRA costs: the time on the tests' tiny FLUX, and per-device memory traffic at full size.

    python scripts/lora_fuse_cost.py [--rank 16] [--tensor 2 8]

Part 1 fuses two kohya LoRAs (ranks 4 and 6, written by the tests' helpers) into the tiny FLUX model on
tensor2 x ulysses2 (8 emulated CPU devices) three times, unfusing between: the first fuse compiles its
programs. Part 2 compiles, from shapes alone (nothing allocated), the fuse programs of a rank-r LoRA on
every kernel of FLUX.1-dev in bf16 on tensor-parallel meshes, and prints the bytes each device moves (each
weight read and written once) and the time that takes at an H200's 4.8 TB/s: a model, not a GPU
measurement.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdit.families import FAMILIES, load_params  # noqa: E402
from jaxdit.lora import fuse_cost, fuse_loras, fuse_memory, unfuse_loras  # noqa: E402
from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.models import flux  # noqa: E402
from jaxdit.models.partitioning import named_shardings  # noqa: E402
from sharding_rules import rules_for  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
HBM_BYTES_PER_S = 4.8e12


def _mesh(**degrees):
    config = ParallelConfig(**degrees)
    return config.make_mesh(jax.devices()[: config.num_devices])


def tiny_fuse_times() -> None:
    import flux_tiny
    import lora_tiny
    from test_lora_fuse import _kohya

    config = flux_tiny.config(lora_tiny.GUIDANCE)
    model = load_params(flux_tiny.diffusers_folder(lora_tiny.GUIDANCE), _mesh(tensor=2, ulysses=2))[1]
    state = nnx.state(model, nnx.Param)
    loras = [(_kohya(), 0.7), (_kohya(1, 6), -0.4)]
    for attempt in range(1, 4):
        start = time.perf_counter()
        fused = fuse_loras(state, config, loras, compiler_options=FAST)
        jax.block_until_ready(jax.tree.leaves(state))
        fuse = time.perf_counter() - start
        start = time.perf_counter()
        unfuse_loras(state, fused)
        jax.block_until_ready(jax.tree.leaves(state))
        unfuse = time.perf_counter() - start
        first = " (compiles included)" if attempt == 1 else ""
        print(
            f"tiny FLUX, 2 LoRAs, tensor2 x ulysses2: fuse {fuse * 1e3:.0f} ms{first}, unfuse {unfuse * 1e3:.0f} ms"
        )
    costs = fuse_memory(state, config, loras, compiler_options=FAST)
    worst = max(costs, key=lambda c: c.extra / c.weight)
    print(
        f"tiny fuse memory: at most {worst.extra / worst.weight:.2f} x a weight's slice beyond it ({worst.target})"
    )


def full_size(rank: int, tensor_degrees: list[int]) -> None:
    config = FAMILIES["flux"].preset_config("flux-dev")
    state = nnx.state(flux.abstract_model(config, jnp.bfloat16), nnx.Param)
    is_var = lambda x: isinstance(x, nnx.Variable)
    place = lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value()))
    for degree in tensor_degrees:
        mesh = _mesh(tensor=degree)
        abstract = jax.tree.map(
            place, state, named_shardings(state, rules_for(tensor=degree), mesh), is_leaf=is_var
        )
        costs = fuse_cost(abstract, rank, compiler_options=FAST)
        moved, weights = sum(c.bytes_moved for c in costs), sum(c.weight for c in costs)
        worst = max(costs, key=lambda c: c.extra)
        print(
            f"FLUX.1-dev bf16, rank {rank}, tensor{degree}: {len(costs)} fuse programs, {weights / 2**30:.2f} GiB "
            f"of kernels and {moved / 2**30:.2f} GiB moved per device (~{moved / HBM_BYTES_PER_S * 1e3:.1f} ms at "
            f"4.8 TB/s, modelled); largest extra memory {worst.extra / 2**20:.1f} MiB ({worst.target})"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tensor", type=int, nargs="+", default=[2, 8])
    args = p.parse_args()
    tiny_fuse_times()
    full_size(args.rank, args.tensor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
