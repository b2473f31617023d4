"""FLUX's autoencoder (diffusers ``AutoencoderKL``; BFL ``src/flux/modules/autoencoder.py``) in Flax NNX.

Encoder: conv_in, per level ``layers_per_block`` ResNet blocks and (except the last level) FLUX's
down-sampling conv, a mid block (ResNet, single-head self-attention, ResNet), GroupNorm, SiLU, conv_out to
2 x latent channels (posterior mean and log-variance). Decoder: conv_in, mid block, per level (lowest
resolution first) ``layers_per_block + 1`` ResNet blocks and (except the last) nearest 2x upsampling +
conv, GroupNorm, SiLU, conv_out. FLUX.1's AE has no quant/post-quant 1x1 convs; other AutoencoderKL
configs may (``use_quant_conv`` / ``use_post_quant_conv``).

Every op goes through :mod:`jaxdit.vae.spatial`, so the same code decodes on one device or with image rows
split over all devices of a mesh (patch parallelism, exact; see that module). Activations are
channels-last ``[B, H, W, C]`` inside; the public API takes and returns NCHW like diffusers.

Precision: weights and convs in the model's dtype with fp32 accumulation; GroupNorm statistics and the
attention softmax in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.models.layers import param
from jaxdit.vae import spatial
from jaxdit.vae.spatial import Rows

__all__ = ["AutoencoderKL", "FluxVAE", "VAEConfig", "abstract_model", "num_parameters", "parameter_shapes"]

_DOWN = "DownEncoderBlock2D"
_UP = "UpDecoderBlock2D"


#: diffusers' AutoencoderKL constructor defaults for the keys where FLUX differs.
_DIFFUSERS_DEFAULTS = {
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "scaling_factor": 0.18215,
    "shift_factor": 0.0,
}


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """An ``AutoencoderKL`` config (diffusers field names); the defaults are FLUX.1's AE."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 16
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    mid_block_add_attention: bool = True
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        if not self.block_out_channels or self.layers_per_block < 1 or self.latent_channels < 1:
            raise ValueError(f"bad VAE config: {self}")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(
                f"block_out_channels {self.block_out_channels}: {bad} not divisible by "
                f"norm_num_groups={self.norm_num_groups}"
            )

    @classmethod
    def preset(cls, name: str = "flux") -> VAEConfig:
        """``"flux"``: FLUX.1's AE (black-forest-labs/FLUX.1-dev ``vae/config.json``: the defaults)."""
        presets = {"flux": {}}
        if name not in presets:
            raise ValueError(f"unknown VAE preset {name!r}; known: {', '.join(presets)}")
        return cls(**presets[name])

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> VAEConfig:
        """From diffusers' ``vae/config.json`` (a dict or a path to it)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        n = len(config.get("block_out_channels", cls.block_out_channels))
        for field, block in (("down_block_types", _DOWN), ("up_block_types", _UP)):
            types = list(config.get(field, [block] * n))
            if types != [block] * n:
                raise ValueError(f"{field} {types}: only {block} is supported")
        act = config.get("act_fn", "silu")
        if act != "silu":
            raise ValueError(f"act_fn {act!r}: only 'silu' is supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        # Keys a config.json leaves out take diffusers' AutoencoderKL defaults (SD's VAE), not FLUX's:
        # FLUX's own config.json sets all four.
        for key, default in _DIFFUSERS_DEFAULTS.items():
            kwargs.setdefault(key, default)
        return cls(**kwargs)

    @property
    def levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def downsample_factor(self) -> int:
        """Pixels per latent along each side (8 for FLUX)."""
        return 2 ** (self.levels - 1)


# --------------------------------------------------------------------------------------------------------
# Modules (local view: one band of rows; see jaxdit.vae.spatial)
# --------------------------------------------------------------------------------------------------------


class Conv(nnx.Module):
    """k x k conv, 'same' zero padding (stride 1) or FLUX's down-sampling (``down``); kernel HWIO."""

    def __init__(self, c_in: int, c_out: int, k: int, *, dtype, rngs: nnx.Rngs, down: bool = False):
        self.kernel = param(rngs, (k, k, c_in, c_out), ("conv_h", "conv_w", "conv_in", "conv_out"), dtype)
        self.bias = param(rngs, (c_out,), ("conv_out",), dtype, init="zeros")
        self.down = down

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        if self.down:
            raise TypeError("a down-sampling conv changes the layout: call .downsample(x, rows)")
        return spatial.conv2d(x, self.kernel[...], self.bias[...], rows)

    def downsample(self, x: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        return spatial.downsample_conv(x, self.kernel[...], self.bias[...], rows)


class GroupNorm(nnx.Module):
    def __init__(self, channels: int, groups: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (channels,), ("norm",), dtype, init="ones")
        self.bias = param(rngs, (channels,), ("norm",), dtype, init="zeros")
        self.groups = groups
        self.eps = eps

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        return spatial.group_norm(x, self.scale[...], self.bias[...], self.groups, rows, self.eps)


def _silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


class ResBlock(nnx.Module):
    """norm1, SiLU, conv1, norm2, SiLU, conv2, plus the input (through a 1x1 conv if channels change)."""

    def __init__(self, c_in: int, c_out: int, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        g, eps = cfg.norm_num_groups, cfg.norm_eps
        self.norm1 = GroupNorm(c_in, g, eps, dtype=dtype, rngs=rngs)
        self.conv1 = Conv(c_in, c_out, 3, dtype=dtype, rngs=rngs)
        self.norm2 = GroupNorm(c_out, g, eps, dtype=dtype, rngs=rngs)
        self.conv2 = Conv(c_out, c_out, 3, dtype=dtype, rngs=rngs)
        self.shortcut = nnx.data(Conv(c_in, c_out, 1, dtype=dtype, rngs=rngs) if c_in != c_out else None)

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        h = self.conv1(_silu(self.norm1(x, rows)), rows)
        h = self.conv2(_silu(self.norm2(h, rows)), rows)
        skip = x if self.shortcut is None else self.shortcut(x, rows)
        return skip + h


class Dense(nnx.Module):
    """A 1x1 projection over channels (diffusers ``Linear``, BFL 1x1 ``Conv2d``); kernel [in, out]."""

    def __init__(self, c: int, *, dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (c, c), ("conv_in", "conv_out"), dtype)
        self.bias = param(rngs, (c,), ("conv_out",), dtype, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        y = jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
        return (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)


class Attention(nnx.Module):
    """Single-head self-attention over all pixels, with GroupNorm in front and the input added back."""

    def __init__(self, c: int, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        self.norm = GroupNorm(c, cfg.norm_num_groups, cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.q = Dense(c, dtype=dtype, rngs=rngs)
        self.k = Dense(c, dtype=dtype, rngs=rngs)
        self.v = Dense(c, dtype=dtype, rngs=rngs)
        self.proj = Dense(c, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        h = self.norm(x, rows)
        out = spatial.attention(self.q(h), self.k(h), self.v(h), rows)
        return x + self.proj(out)


class MidBlock(nnx.Module):
    def __init__(self, c: int, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        self.res1 = ResBlock(c, c, cfg, dtype=dtype, rngs=rngs)
        attn = Attention(c, cfg, dtype=dtype, rngs=rngs) if cfg.mid_block_add_attention else None
        self.attn = nnx.data(attn)
        self.res2 = ResBlock(c, c, cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rows: Rows) -> jax.Array:
        x = self.res1(x, rows)
        if self.attn is not None:
            x = self.attn(x, rows)
        return self.res2(x, rows)


class Level(nnx.Module):
    """One resolution: ResNet blocks, then an optional resampling conv (down: stride 2; up: after 2x)."""

    def __init__(self, c_in, c_out, n, resample, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        self.res = nnx.List(
            [ResBlock(c_in if i == 0 else c_out, c_out, cfg, dtype=dtype, rngs=rngs) for i in range(n)]
        )
        down = resample == "down"
        conv = Conv(c_out, c_out, 3, dtype=dtype, rngs=rngs, down=down) if resample else None
        self.resample = nnx.data(conv)


class Encoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        ch = cfg.block_out_channels
        self.conv_in = Conv(cfg.in_channels, ch[0], 3, dtype=dtype, rngs=rngs)
        self.down = nnx.List(
            [
                Level(
                    ch[max(i - 1, 0)],
                    c,
                    cfg.layers_per_block,
                    "down" if i < cfg.levels - 1 else None,
                    cfg,
                    dtype=dtype,
                    rngs=rngs,
                )
                for i, c in enumerate(ch)
            ]
        )
        self.mid = MidBlock(ch[-1], cfg, dtype=dtype, rngs=rngs)
        self.norm_out = GroupNorm(ch[-1], cfg.norm_num_groups, cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.conv_out = Conv(ch[-1], 2 * cfg.latent_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        h = self.conv_in(x, rows)
        for level in self.down:
            for res in level.res:
                h = res(h, rows)
            if level.resample is not None:
                h, rows = level.resample.downsample(h, rows)
        h = self.mid(h, rows)
        return self.conv_out(_silu(self.norm_out(h, rows)), rows), rows


class Decoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        ch = tuple(reversed(cfg.block_out_channels))
        self.conv_in = Conv(cfg.latent_channels, ch[0], 3, dtype=dtype, rngs=rngs)
        self.mid = MidBlock(ch[0], cfg, dtype=dtype, rngs=rngs)
        self.up = nnx.List(
            [
                Level(
                    ch[max(i - 1, 0)],
                    c,
                    cfg.layers_per_block + 1,
                    "up" if i < cfg.levels - 1 else None,
                    cfg,
                    dtype=dtype,
                    rngs=rngs,
                )
                for i, c in enumerate(ch)
            ]
        )
        self.norm_out = GroupNorm(ch[-1], cfg.norm_num_groups, cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.conv_out = Conv(ch[-1], cfg.out_channels, 3, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        h = self.mid(self.conv_in(z, rows), rows)
        for level in self.up:
            for res in level.res:
                h = res(h, rows)
            if level.resample is not None:
                h, rows = spatial.upsample_nearest(h, rows)
                h = level.resample(h, rows)
        return self.conv_out(_silu(self.norm_out(h, rows)), rows), rows


class AutoencoderKL(nnx.Module):
    """The parameters and the local (per-band) encode/decode; :class:`FluxVAE` is the user-facing API."""

    def __init__(self, config: VAEConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)
        z2, z = 2 * config.latent_channels, config.latent_channels
        qc = Conv(z2, z2, 1, dtype=dtype, rngs=rngs) if config.use_quant_conv else None
        pqc = Conv(z, z, 1, dtype=dtype, rngs=rngs) if config.use_post_quant_conv else None
        self.quant_conv = nnx.data(qc)
        self.post_quant_conv = nnx.data(pqc)

    def encode_local(self, x: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        """[B, local, W, C_in] pixels -> [B, local / f, W / f, 2 x latent] moments (mean, logvar)."""
        h, rows = self.encoder(x, rows)
        if self.quant_conv is not None:
            h = self.quant_conv(h, rows)
        return h, rows

    def decode_local(self, z: jax.Array, rows: Rows) -> tuple[jax.Array, Rows]:
        """[B, local, W, latent] unscaled latents -> [B, local x f, W x f, C_out] pixels."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z, rows)
        return self.decoder(z, rows)


def abstract_model(config: VAEConfig, dtype: Any = jnp.float32) -> AutoencoderKL:
    """The model with ``jax.ShapeDtypeStruct`` parameters: nothing allocated."""
    return nnx.eval_shape(lambda: AutoencoderKL(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: VAEConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape."""
    return dict(_parameter_shapes(config))


@functools.lru_cache(maxsize=32)
def _parameter_shapes(config: VAEConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    state = nnx.state(abstract_model(config), nnx.Param)
    return tuple((".".join(map(str, p)), tuple(v.shape)) for p, v in nnx.to_flat_state(state))


# --------------------------------------------------------------------------------------------------------
# User-facing wrapper
# --------------------------------------------------------------------------------------------------------


def _num_tiles(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.devices.size)


class FluxVAE:
    """FLUX's AE with diffusers' ``AutoencoderKL`` call semantics, optionally row-sharded over a mesh.

    ``decode(z, mesh)``: unscaled latents NCHW -> pixels NCHW (not clamped); with a mesh, the rows are
    split over ALL devices of the mesh (a 1-D view of ``mesh.devices.flat``). ``encode(x, mesh)``: pixels
    NCHW -> (posterior mean, log-variance) NCHW, log-variance clipped to [-30, 20] like diffusers.
    ``decode_latents(z_scaled, mesh)``: the pipelines' step, ``z / scaling + shift`` then decode, NHWC
    clipped to [-1, 1].
    """

    def __init__(self, model: AutoencoderKL, *, compiler_options: Mapping[str, Any] | None = None):
        self.config: VAEConfig = model.config
        self.graphdef, self.state = nnx.split(model)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self._placed: dict[Any, Any] = {}
        self._programs: dict[Any, Any] = {}

    # ---------------------------------------------------------------------------------- construction
    @classmethod
    def random(cls, config: VAEConfig, dtype: Any = jnp.float32, seed: int = 0, **kw) -> FluxVAE:
        """Random weights drawn with numpy (no per-shape device compiles): kernels N(0, 1/fan_in), norm
        scales 1 + N(0, 0.1^2), biases N(0, 0.1^2). For tests and demos."""
        rng = np.random.default_rng(seed)
        graphdef, abstract = nnx.split(abstract_model(config, dtype))

        def draw(path, v):
            name, shape = str(path[-1]), v.shape
            if name == "kernel":
                x = rng.standard_normal(shape) / math.sqrt(math.prod(shape[:-1]))
            else:
                x = (1.0 if name == "scale" else 0.0) + 0.1 * rng.standard_normal(shape)
            return path, v.replace(jnp.asarray(x, dtype))

        filled = [draw(p, v) for p, v in nnx.to_flat_state(abstract)]
        return cls(nnx.merge(graphdef, nnx.from_flat_state(filled)), **kw)

    @classmethod
    def abstract(cls, config: VAEConfig | None = None, dtype: Any = jnp.bfloat16, **kw) -> FluxVAE:
        """Abstract parameters (``ShapeDtypeStruct``): only :meth:`lower_decode` / :meth:`lower_encode` work,
        e.g. to measure compiled memory of the full-size AE without allocating it."""
        return cls(abstract_model(config or VAEConfig.preset(), dtype), **kw)

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree.leaves(self.state)[0].dtype

    # ------------------------------------------------------------------------------------ programs
    def _params_on(self, mesh: Mesh | None):
        """The parameters replicated on the tile mesh (once per mesh)."""
        if mesh is None or isinstance(jax.tree.leaves(self.state)[0], jax.ShapeDtypeStruct):
            return self.state
        key = tuple(d.id for d in mesh.devices.flat)
        if key not in self._placed:
            sharding = NamedSharding(spatial.tile_mesh(mesh), PartitionSpec())
            self._placed[key] = jax.device_put(self.state, sharding)
        return self._placed[key]

    def _body(self, kind: str, rows: Rows, mesh: Mesh | None):
        """(state, x_padded NHWC) -> y_padded NHWC for ``kind`` in ('decode', 'encode'), not jitted."""
        graphdef = self.graphdef

        def local(state, x):
            model = nnx.merge(graphdef, state)
            fn = model.decode_local if kind == "decode" else model.encode_local
            return fn(x, rows)[0]

        if mesh is None:
            return local
        spec = spatial.row_spec(4)
        return jax.shard_map(
            local,
            mesh=spatial.tile_mesh(mesh),
            in_specs=(PartitionSpec(), spec),
            out_specs=spec,
            check_vma=False,
        )

    def _program(self, kind: str, rows: Rows, mesh: Mesh | None):
        """The jitted core program (what :meth:`lower_decode` lowers)."""
        key = (kind, rows, None if mesh is None else tuple(d.id for d in mesh.devices.flat))
        if key not in self._programs:
            body = self._body(kind, rows, mesh)
            self._programs[key] = jax.jit(body, compiler_options=self.compiler_options)
        return self._programs[key]

    def _rows(self, kind: str, height: int, mesh: Mesh | None) -> Rows:
        tiles = _num_tiles(mesh)
        if kind == "decode":
            return Rows.split(height, tiles)
        # Bands of a multiple of 2**levels rows halve evenly at every down-sampling. Any height works,
        # with diffusers' floor semantics (H -> floor(H / 2) per level): padding rows are zero, exactly
        # the pad row the stride-2 conv adds below the image.
        f = self.config.downsample_factor
        if height < f:
            raise ValueError(f"image height {height} is smaller than the AE's downsampling factor {f}")
        return Rows.split(height, tiles, multiple=f)

    def _lower(self, kind: str, shape: Sequence[int], mesh: Mesh | None, dtype: Any):
        b, c, h, w = shape
        rows = self._rows(kind, h, mesh)
        x_sharding = p_sharding = None
        if mesh is not None:  # the shardings a real call has, so a later call reuses the compile
            tmesh = spatial.tile_mesh(mesh)
            x_sharding = NamedSharding(tmesh, spatial.row_spec(4))
            p_sharding = NamedSharding(tmesh, PartitionSpec())
        x = jax.ShapeDtypeStruct((b, rows.padded, w, c), jnp.dtype(dtype or self.dtype), sharding=x_sharding)
        state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p_sharding), self.state
        )
        return self._program(kind, rows, mesh).lower(state, x)

    def lower_decode(self, latent_shape: Sequence[int], mesh: Mesh | None = None, dtype: Any = None):
        """``jax.stages.Lowered`` of the core decode program (padded NHWC band in and out; the program
        the mesh runs) for NCHW latents of ``latent_shape``; parameters may be abstract."""
        return self._lower("decode", latent_shape, mesh, dtype)

    def lower_encode(self, image_shape: Sequence[int], mesh: Mesh | None = None, dtype: Any = None):
        """``jax.stages.Lowered`` of the core encode program for NCHW images of ``image_shape``."""
        return self._lower("encode", image_shape, mesh, dtype)

    def _runner(self, kind: str, rows: Rows, mesh: Mesh | None):
        """NCHW in -> NCHW out around the core program: transpose and row padding before it, unpadding
        after it. One jit on a single device; with a mesh, the core program stays a separate jit so that
        it alone is the sharded program (``lower_decode``), fed row-sharded input directly."""
        key = ("run", kind, rows, None if mesh is None else tuple(d.id for d in mesh.devices.flat))
        if key in self._programs:
            return self._programs[key]
        f = self.config.downsample_factor
        real = rows.rows * f if kind == "decode" else rows.rows // f
        dtype = self.dtype

        def pre(x):
            return spatial.pad_rows(jnp.transpose(x, (0, 2, 3, 1)).astype(dtype), rows)

        def post(y):
            return jnp.transpose(y[:, :real], (0, 3, 1, 2))

        if mesh is None:
            body = self._body(kind, rows, None)
            run = jax.jit(lambda state, x: post(body(state, pre(x))), compiler_options=self.compiler_options)
        else:
            core = self._program(kind, rows, mesh)
            sharding = NamedSharding(spatial.tile_mesh(mesh), spatial.row_spec(4))
            pre_j = jax.jit(pre, out_shardings=sharding)
            post_j = jax.jit(post)

            def run(state, x):
                return post_j(core(state, pre_j(x)))

        self._programs[key] = run
        return run

    def _run(self, kind: str, x_nchw: jax.Array, mesh: Mesh | None) -> jax.Array:
        x = jnp.asarray(x_nchw)
        if x.ndim != 4:
            raise ValueError(f"expected NCHW input, got shape {x.shape}")
        want = self.config.latent_channels if kind == "decode" else self.config.in_channels
        if x.shape[1] != want:
            raise ValueError(f"{kind} expects {want} channels (NCHW), got shape {tuple(x.shape)}")
        rows = self._rows(kind, x.shape[2], mesh)
        return self._runner(kind, rows, mesh)(self._params_on(mesh), x)

    # --------------------------------------------------------------------------------------- public
    def decode(self, z: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """Unscaled latents [B, latent, h, w] -> pixels [B, out, 8h, 8w] (NCHW, not clamped)."""
        return self._run("decode", z, mesh)

    def encode(self, x: jax.Array, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
        """Pixels [B, in, H, W] in [-1, 1] -> (mean, logvar), each [B, latent, H/8, W/8] (NCHW).

        The moments are unscaled (diffusers' ``latent_dist``); apply ``scaling * (mean - shift)`` for the
        transformer's latents.
        """
        moments = self._run("encode", x, mesh)
        mean, logvar = jnp.split(moments, 2, axis=1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode_latents(self, z_scaled: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """Scaled latents (as the transformer sees them), NCHW -> images NHWC in [-1, 1] (fp32)."""
        cfg = self.config
        z = jnp.asarray(z_scaled, jnp.float32) / cfg.scaling_factor + cfg.shift_factor
        x = jnp.transpose(self.decode(z, mesh).astype(jnp.float32), (0, 2, 3, 1))
        # Clipping would turn an overflow (inf) into a plausible white pixel: non-finite values stay NaN so
        # that the pipeline's check of the decoded pixels sees them.
        return jnp.where(jnp.isfinite(x), jnp.clip(x, -1.0, 1.0), jnp.nan)


def num_parameters(config: VAEConfig) -> int:
    """Parameter count (83.8 M for FLUX's AE)."""
    return sum(math.prod(s) for s in parameter_shapes(config).values())
