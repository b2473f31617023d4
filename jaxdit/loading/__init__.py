"""From checkpoints to models on devices, for any model family: parameters placed on a mesh
(:mod:`~jaxdit.loading.params`), encoders on one device (:mod:`~jaxdit.loading.encoders`), VAEs
(:mod:`~jaxdit.loading.vae`). The layer above ``converters`` (which read the files) and below
``pipelines`` (which assemble a whole model folder)."""

from jaxdit.loading.params import checkpoint_config, convert_checkpoint, flat_path, load_params, resolve_keys

__all__ = ["checkpoint_config", "convert_checkpoint", "flat_path", "load_params", "resolve_keys"]
