"""PipeFusion (Fang et al., arXiv 2405.14430) for every model family: one runner over the staged forward.

- ``runner``: the entry point a pipeline calls (:class:`PipeFusionRunner`: latent tokens, forward
  context, sampler and schedule in; final latent tokens out), warm-up steps then one pipelined call;
- ``programs``: the two compiled programs (warm-up step, pipelined ``lax.scan`` over ticks), written once,
  generic over the passes (the model's block stacks), the sampler and the family;
- ``family``: what the runner asks of a family (the adapter's protocol);
- ``geometry``: how a generation's tokens lie in patches and sequence-shard pieces (layouts, masks);
- ``stages``: a model's block stacks laid out in stage slots (1/P of every stack per device);
- ``cache``: the host-planned feature caches (MagCache, TaylorSeer) under PipeFusion, and why the
  data-dependent ones are refused;
- ``flux``, ``wan``: each family's adapter: its geometry, checks, cost terms, and how a patch is
  embedded and conditioned by the model's own staged pieces.

The schedule, the stale-K/V attention and every collective are in ``jaxdit.parallel.pipefusion``; the
prompt-to-image pipelines over this runner are ``jaxdit.pipelines.pipefusion_flux`` and
``pipefusion_wan``.
"""

from jaxdit.pipelines.pipefusion.family import PatchFamily, PatchPieces
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry
from jaxdit.pipelines.pipefusion.programs import PipeFusionPrograms
from jaxdit.pipelines.pipefusion.runner import PipeFusionRunner, RunnerPrograms, lower
from jaxdit.pipelines.pipefusion.stages import StagedModel, StageOrdered

__all__ = [
    "PatchFamily",
    "PatchGeometry",
    "PatchPieces",
    "PipeFusionPrograms",
    "PipeFusionRunner",
    "RunnerPrograms",
    "StageOrdered",
    "StagedModel",
    "lower",
]
