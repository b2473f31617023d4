"""jaxdit: diffusion transformers sharded over a named JAX device mesh to cut one generation's latency."""

from jaxdit import distributed
from jaxdit.mesh import MESH_AXES, ParallelConfig

__all__ = ["MESH_AXES", "ParallelConfig", "distributed", "load_transformer"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Deferred: loading pulls in flax, the models and the converters, which `import jaxdit` need not pay for.
    if name == "load_transformer":
        from jaxdit.families import load_transformer

        return load_transformer
    raise AttributeError(f"module 'jaxdit' has no attribute {name!r}")
