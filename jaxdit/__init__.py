"""jaxdit: diffusion transformers sharded over a named JAX device mesh to cut one generation's latency."""

from jaxdit import distributed
from jaxdit.mesh import MESH_AXES, ParallelConfig

__all__ = ["MESH_AXES", "ParallelConfig", "distributed"]
__version__ = "0.1.0"
