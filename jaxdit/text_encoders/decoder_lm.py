"""A decoder-LM text encoder in Flax NNX: token ids -> the hidden states a pipeline asks for.

One config-driven module for the decoders that 2025-26 diffusion models use as text encoders: Qwen2.5-VL
(Qwen-Image, HunyuanVideo 1.5), Qwen3 (Z-Image, FLUX.2 klein), Mistral Small 3.1 (FLUX.2 dev). It follows
transformers' ``Qwen2_5_VLTextModel`` / ``Qwen3Model`` / ``MistralModel`` run on text: token embedding,
``num_hidden_layers`` :class:`~jaxdit.text_encoders.decoder_lm_layers.DecoderLayer` s (stacked and run
with ``lax.scan``, so compile time does not grow with depth), a final RMSNorm. Positions are 0..L-1 for
every row (transformers' default for text); prompts of different lengths are padded on the right and
their padding keys masked, so each prompt's real tokens see exactly what they would see alone.

``layers`` picks the output the way transformers' ``hidden_states`` tuple is indexed: 0 the embeddings,
i the output of layer i, ``num_hidden_layers`` (or -1) the final normed output. One index gives
[B, L, E]; a tuple gives them stacked on axis 1, [B, n, L, E], as FLUX.2's pipelines stack them. Layers
past the deepest index asked for are not run.

:class:`DecoderLMRunner` runs it jitted on one device or on a mesh, sharded by
``sharding_rules.decoder_lm`` (heads and MLP over ``tensor``, batch over data/cfg, sequence over the
sequence axes; XLA inserts the collectives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxdit.models.layers import param, rms_norm
from jaxdit.models.partitioning import logical_axes
from jaxdit.text_encoders.common import stack_blocks
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig, rope_inverse_frequencies
from jaxdit.text_encoders.decoder_lm_layers import Constrain, DecoderLayer, no_constraint
from sharding_rules import logical_to_spec
from sharding_rules.decoder_lm import DECODER_LM, decoder_lm_rules

__all__ = [
    "DecoderLM",
    "DecoderLMRunner",
    "abstract_model",
    "check_tensor_degree",
    "parameter_bytes_per_device",
]

Layers = int | Sequence[int] | None


class DecoderLM(nnx.Module):
    """Embedding, stacked decoder layers and the final norm (parameters named as in transformers)."""

    def __init__(self, config: DecoderLMConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.embed_tokens = param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype, scale=1.0
        )
        self.layers = stack_blocks(
            lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), cfg.num_hidden_layers, rngs
        )
        self.norm = param(rngs, (cfg.hidden_size,), ("embed",), dtype, init="ones")

    def layer_indices(self, layers: Layers) -> tuple[int, ...]:
        """``layers`` as transformers' ``hidden_states`` indices in 0..num_hidden_layers (checked)."""
        n = self.config.num_hidden_layers
        wanted = (n,) if layers is None else (layers,) if isinstance(layers, int) else tuple(layers)
        if not wanted:
            raise ValueError("layers is empty; give a hidden-state index or a list of them")
        out = []
        for i in wanted:
            if not isinstance(i, int | np.integer) or not -(n + 1) <= i <= n:
                raise ValueError(
                    f"hidden-state index {i!r} is out of range for a {n}-layer encoder: 0 is the "
                    f"embeddings, 1..{n} the layers' outputs ({n} and -1 the final normed output)"
                )
            out.append(int(i) % (n + 1))
        return tuple(out)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        layers: Layers = None,
        constrain: Constrain = no_constraint,
        inputs_embeds: jax.Array | None = None,
        position_ids: jax.Array | None = None,
    ) -> jax.Array:
        """input_ids [B, L] int; attention_mask [B, L] (1 = token, 0 = padding) or None -> hidden states in
        fp32: [B, L, E] for one index (default: the final normed output), [B, n, L, E] for a tuple.

        ``inputs_embeds`` [B, L, E] replaces the token lookup (image tokens spliced in by a vision tower);
        ``position_ids`` [3, B, L] gives Qwen2.5-VL's (time, row, column) positions, combined by the
        config's ``mrope_section`` (transformers' multimodal RoPE); without it positions are 0..L-1."""
        cfg = self.config
        indices = self.layer_indices(layers)
        length = input_ids.shape[1]
        if cfg.sliding_window is not None and length > cfg.sliding_window:
            raise ValueError(
                f"{length} tokens exceed the checkpoint's sliding window of {cfg.sliding_window}; the "
                "encoder runs full causal attention, so it encodes at most that many tokens"
            )
        inv = rope_inverse_frequencies(cfg)
        if position_ids is None:
            angles = jnp.asarray(np.arange(length, dtype=np.float32)[:, None] * inv[None])
        else:
            angles = _mrope_angles(cfg, position_ids, inv)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        causal = jnp.tril(jnp.ones((length, length), bool))
        keys = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask > 0
        mask = (causal[None] & keys[:, None, :])[:, None, None]  # [B, 1, 1, L, M]

        embeds = self.embed_tokens[...][input_ids] if inputs_embeds is None else inputs_embeds
        x = constrain(embeds.astype(jnp.float32), ("batch", "seq", None))
        graphdef, state = nnx.split(self.layers)

        def body(h, layer_state):
            return nnx.merge(graphdef, layer_state)(h, cos, sin, mask, constrain), None

        captured: dict[int, jax.Array] = {0: x}
        done = 0
        for stop in sorted({min(i, cfg.num_hidden_layers) for i in indices if i > 0}):
            segment = jax.tree.map(lambda a, lo=done, hi=stop: a[lo:hi], state)
            x, _ = jax.lax.scan(body, x, segment)
            captured[stop], done = x, stop
        if cfg.num_hidden_layers in captured and cfg.num_hidden_layers > 0:
            captured[cfg.num_hidden_layers] = rms_norm(
                captured[cfg.num_hidden_layers], self.norm[...], cfg.rms_norm_eps
            )
        outs = [captured[i] for i in indices]
        single = layers is None or isinstance(layers, int | np.integer)
        return outs[0] if single else jnp.stack(outs, axis=1)


def _mrope_angles(cfg: DecoderLMConfig, position_ids: jax.Array, inv: np.ndarray) -> jax.Array:
    """[B, L, D/2] rotation angles from [3, B, L] positions: frequency j turns with the position on axis
    (section of j) mod 3, the sections taken in order from ``mrope_section``."""
    if cfg.mrope_section is None:
        raise ValueError("3-axis position ids need the config's mrope_section (a Qwen2.5-VL checkpoint)")
    if position_ids.ndim != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"position_ids must be [3, batch, tokens], got shape {position_ids.shape}")
    axis = np.repeat(np.arange(len(cfg.mrope_section)) % 3, cfg.mrope_section)
    per_axis = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [3, B, L, D/2]
    return jnp.take_along_axis(per_axis, jnp.asarray(axis)[None, None, None, :], axis=0)[0]


def abstract_model(config: DecoderLMConfig, dtype: Any = jnp.float32) -> DecoderLM:
    """The encoder with ``jax.ShapeDtypeStruct`` parameters (shapes and logical axes, nothing allocated)."""
    return nnx.eval_shape(lambda: DecoderLM(config, dtype=dtype, rngs=nnx.Rngs(0)))


def check_tensor_degree(config: DecoderLMConfig, tensor: int) -> None:
    """Raise unless query heads, key/value heads and the MLP width all split over ``tensor``."""
    sizes = {
        "query heads": config.num_attention_heads,
        "key/value heads": config.num_key_value_heads,
        "MLP width": config.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tensor}
    if bad:
        valid = [
            t for t in range(1, config.num_key_value_heads + 1) if all(v % t == 0 for v in sizes.values())
        ]
        raise ValueError(
            f"the decoder-LM encoder cannot be split over tensor={tensor}: "
            + ", ".join(f"{v} {k}" for k, v in bad.items())
            + f" do not divide; valid tensor degrees: {', '.join(map(str, valid))}"
        )


def parameter_bytes_per_device(config: DecoderLMConfig, dtype: Any = jnp.bfloat16, tensor: int = 1) -> int:
    """Bytes of parameters each device holds when the encoder is split over ``tensor`` (from abstract
    shapes and the rule table; nothing is allocated)."""
    check_tensor_degree(config, tensor)
    rules = decoder_lm_rules(tensor)
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(abstract_model(config, dtype), nnx.Param)):
        spec = logical_to_spec(logical_axes(var), rules)
        parts = tuple(spec) + (None,) * (len(var.shape) - len(spec))
        shape = [
            math.ceil(d / (tensor if p == "tensor" else 1)) for d, p in zip(var.shape, parts, strict=True)
        ]
        total += math.prod(shape) * jnp.dtype(var.dtype).itemsize
    return total


class DecoderLMRunner:
    """The encoder jitted on one device or on a mesh: numpy ids and mask in, hidden states out.

    On a mesh the parameters must already be placed by the rule table (``jaxdit.loading.decoder_lm``
    does); the batch is padded to a multiple of data x cfg and the sequence to a multiple of the
    sequence axes' product with masked tokens (causal attention: tokens appended at the end change
    nothing before them), and the padding is cut off the result.

    ``offload`` (one device only): the parameters leave the device now and wait in host memory; each call
    copies them in, runs and frees them, so between prompts the device holds none of the encoder.
    """

    def __init__(
        self,
        model: DecoderLM,
        mesh: Mesh | None = None,
        rules: Mapping[str, object] | None = None,
        *,
        offload: bool = False,
    ):
        self.model = model
        self.mesh = mesh
        self.rules = (
            rules if rules is not None else (decoder_lm_rules(mesh.shape["tensor"]) if mesh else DECODER_LM)
        )
        graphdef, state = nnx.split(model)
        self._state = state
        self._host = None
        if offload:
            if mesh is not None:
                raise ValueError("offload keeps a one-device encoder in host memory; this one is on a mesh")
            (self._device,) = {d for leaf in jax.tree.leaves(state) for d in leaf.devices()}
            self._host = jax.device_get(state)
            for leaf in jax.tree.leaves(state):
                leaf.delete()  # only the host copy is used from now on

        def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
            if mesh is None:
                return x
            return jax.lax.with_sharding_constraint(
                x, NamedSharding(mesh, logical_to_spec(names, self.rules))
            )

        def run(st, ids, mask, layers):
            return nnx.merge(graphdef, st)(ids, mask, layers=layers, constrain=constrain)

        self._jitted = jax.jit(run, static_argnums=(3,))

    def _multiple(self, name: str) -> int:
        """How many shards the logical axis ``name`` is cut into on the mesh (1 on one device)."""
        if self.mesh is None:
            return 1
        target = self.rules.get(name)
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        return math.prod(int(self.mesh.shape[a]) for a in axes)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, layers: Layers = None) -> jax.Array:
        ids = np.asarray(input_ids, np.int32)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {ids.shape}")
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {mask.shape} does not match input_ids {ids.shape}")
        self.model.layer_indices(layers)  # bad indices fail here, before compiling
        b, length = ids.shape
        pad_b = -b % self._multiple("batch")
        pad_l = -length % self._multiple("seq")
        ids = np.pad(ids, ((0, pad_b), (0, pad_l)))
        mask = np.pad(mask, ((0, pad_b), (0, pad_l)))
        if self.mesh is not None:
            where = NamedSharding(self.mesh, logical_to_spec(("batch", "seq"), self.rules))
            ids, mask = jax.device_put(ids, where), jax.device_put(mask, where)
        key = layers if layers is None or isinstance(layers, int) else tuple(int(i) for i in layers)
        if self._host is None:
            return self._jitted(self._state, ids, mask, key)[:b, ..., :length, :]
        on_device = jax.device_put(self._host, self._device)
        try:
            out = jax.block_until_ready(self._jitted(on_device, ids, mask, key))
        finally:
            for leaf in jax.tree.leaves(on_device):
                leaf.delete()
        return out[:b, ..., :length, :]
