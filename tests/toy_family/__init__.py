"""A model family defined entirely inside the tests: the proof that a family plugs into jaxdit through
its own files and one ``jaxdit.families.register`` call (docs/architecture.md, "Adding a model family: the checklist").

- ``model.py``: the transformer (a tiny single-stream DiT on the shared layers and ``ShardedForward``);
- ``converter.py``: its checkpoint folder, key table and ``CheckpointFormat``;
- ``pipeline.py``: its pipeline on ``DiffusionPipeline`` and the shared ``Denoiser`` / Euler sampler;
- ``family.py``: the ``ModelFamily`` object that ties them together (``TOY``).
"""

from .family import TOY, ToyFamily

__all__ = ["TOY", "ToyFamily"]
