"""One decoder layer of a decoder-LM text encoder: RMSNorm, grouped-query causal attention with RoPE and a
key padding mask, SwiGLU MLP (Qwen2 / Qwen2.5-VL text, Qwen3, Mistral; switches in ``DecoderLMConfig``).

x += o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x)))); x += down(silu(gate(n2(x))) * up(n2(x))).
Qwen3 adds an RMSNorm over each head of q and k before RoPE. RoPE rotates the two halves of each head
(the GPT-NeoX / transformers ``rotate_half`` layout, not interleaved pairs). Grouped-query attention
(Ainslie et al., arXiv 2305.13245): query head h reads key/value head h // (H / K).

Precision: weights and matmuls in the encoder's dtype with fp32 accumulation; the residual stream, norms,
RoPE and softmax in fp32. Parameters carry logical axes (``heads``/``mlp`` split by the rule table's
tensor axis); ``constrain(x, names)`` pins an activation's logical layout on a mesh, or does nothing.

Shape letters: B batch, L query tokens, M key tokens, H query heads, K key/value heads, G = H / K,
D head_dim, E hidden, F MLP hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.layers import Linear, param, rms_norm
from jaxdit.text_encoders.common import MASKED
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig

__all__ = ["Constrain", "DecoderLayer", "apply_rope_halves", "no_constraint"]

#: ``constrain(x, logical_names)``: an activation's layout on the mesh (identity on one device).
Constrain = Callable[[jax.Array, Sequence[str | None]], jax.Array]


def no_constraint(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    return x


def apply_rope_halves(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate dimension j with j + D/2 by the angle of frequency j; x [B, L, N, D], cos/sin [L, D/2] (the
    same positions for every row) or [B, L, D/2] (per-row positions); fp32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = (cos[None], sin[None]) if cos.ndim == 2 else (cos, sin)
    c, s = c[:, :, None, :], s[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class DecoderLayer(nnx.Module):
    """Causal self-attention and a SwiGLU MLP, each pre-normed with a residual (transformers' names)."""

    def __init__(self, cfg: DecoderLMConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.input_layernorm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.q_proj = Linear(e, cfg.q_width, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=cfg.qkv_bias)
        self.k_proj = Linear(e, cfg.kv_width, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=cfg.qkv_bias)
        self.v_proj = Linear(e, cfg.kv_width, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_width, e, ("heads", "embed"), rngs=rngs, dtype=dtype, bias=cfg.o_bias)
        d = cfg.head_dim
        self.q_norm = param(rngs, (d,), ("head_dim",), dtype, init="ones") if cfg.qk_norm else None
        self.k_norm = param(rngs, (d,), ("head_dim",), dtype, init="ones") if cfg.qk_norm else None
        self.post_attention_layernorm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.gate_proj = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.up_proj = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.down_proj = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.eps = cfg.rms_norm_eps
        self.head_dim = d
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads

    def _heads(self, y: jax.Array, norm: nnx.Param | None) -> jax.Array:
        """[B, L, N*D] -> [B, L, N, D], RMS-normed per head where the model has q/k norms (fp32)."""
        y = y.reshape(*y.shape[:-1], -1, self.head_dim)
        return y.astype(jnp.float32) if norm is None else rms_norm(y, norm[...], self.eps)

    def attention(
        self, h: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, constrain: Constrain
    ) -> jax.Array:
        """h [B, L, E] normed, in the compute dtype; mask [B, 1, 1, L, M] bool (True: key visible)."""
        dtype = self.q_proj.kernel.dtype
        q = apply_rope_halves(self._heads(self.q_proj(h), self.q_norm), cos, sin).astype(dtype)
        k = apply_rope_halves(self._heads(self.k_proj(h), self.k_norm), cos, sin).astype(dtype)
        v = self._heads(self.v_proj(h), None).astype(dtype)
        b, length, kv_heads, d = k.shape
        q = constrain(
            q.reshape(b, length, kv_heads, self.groups, d), ("batch", "seq", "act_heads", None, None)
        )
        # Every query reads every earlier key: keys and values are whole along the sequence.
        k = constrain(k, ("batch", None, "act_heads", None))
        v = constrain(v, ("batch", None, "act_heads", None))
        s = jnp.einsum("blkgd,bmkd->bkglm", q, k, preferred_element_type=jnp.float32) * (d**-0.5)
        p = jax.nn.softmax(jnp.where(mask, s, MASKED), axis=-1)
        out = jnp.einsum("bkglm,bmkd->blkgd", p.astype(dtype), v, preferred_element_type=jnp.float32)
        return self.o_proj(out.reshape(b, length, -1).astype(dtype))

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, constrain: Constrain
    ) -> jax.Array:
        """x [B, L, E] fp32 residual stream -> the same after this layer."""
        dtype = self.q_proj.kernel.dtype
        h = rms_norm(x, self.input_layernorm[...], self.eps).astype(dtype)
        x = constrain(
            x + self.attention(h, cos, sin, mask, constrain).astype(jnp.float32), ("batch", "seq", None)
        )
        h = rms_norm(x, self.post_attention_layernorm[...], self.eps).astype(dtype)
        gate = jax.nn.silu(self.gate_proj(h).astype(jnp.float32))
        hidden = constrain(
            (gate * self.up_proj(h).astype(jnp.float32)).astype(dtype), ("batch", "seq", "act_mlp")
        )
        return constrain(x + self.down_proj(hidden).astype(jnp.float32), ("batch", "seq", None))
