"""The analytic cost of one denoising step on a :class:`ParallelConfig`: bytes each device sends, FLOPs,
parameter and activation memory per device. docs/parallelism.md writes every formula out.

Everything is per device and per denoising step, and follows what jaxdit's programs do (each term says
which code it models), so that ``jaxdit plan --verify`` can hold it against the compiled HLO:

- Ulysses (``parallel/ulysses.py``): 4 all-to-alls per attention layer (q, k, v, output), each of the
  local [b, n, H/T, D] block; (U-1)/U of it leaves the device.
- Ring (``parallel/ring.py``): R-1 hops, each a collective-permute of K and one of V (the same block
  size: after Ulysses a ring member holds U shards' tokens for H/(U T) heads); overlapped with the
  local attention of the block in hand.
- Tensor (``models/*.py``, Megatron): one fp32 all-reduce of the [b, n, E] partial sums after each
  row-parallel projection (FLUX double block: attention-out and MLP-down of each stream; single block:
  ONE, linear2 reads [attention | MLP]; Wan: self-attention o, cross-attention o, FFN-down), plus Wan's
  two small all-reduces of per-token sums of squares (q/k RMSNorm across all heads).
- CFG (``parallel/cfg.py``): one collective-permute of this device's share of one noise prediction per
  step (FLUX predicts in the model dtype, Wan's head in fp32).
- PipeFusion (from its design; ``parallel/pipefusion.py`` was being written alongside): each stack of
  blocks is split over the P stages (ceil(L/P) blocks of every stack per device) and the latent into M
  patches; a patch makes V passes over the stages (FLUX: double blocks up, single blocks back down, V=2;
  Wan: V=1), so per tick each device sends V collective-permutes of one patch's fp32 residual stream,
  overlapped with the tick's compute; Wan's pass ends on the last stage, which also sends the updated
  fp32 latent patch back to stage 0 each tick (``pipelines/pipefusion/programs.py``). M = V x P keeps the
  pipeline full. Stale K/V never leaves its device but costs memory.
- Data: nothing.

Bytes follow ``jaxdit.hlo_stats`` conventions (``bytes_sent``: all-to-all (P-1)/P of the operand,
collective-permute the operand, all-reduce 2(P-1)/P of it). ``cpu=True`` prices bf16 collectives at 4
bytes per element, as the CPU backend widens them (reference/jax-facts.md); fp32 ones are unchanged.

FLOPs count matmuls (dots) only, like ``hlo_stats.flops_per_device``: 2 per multiply-add, attention on the
tiles the local kernel really computes (``parallel/local_attention.py`` pads queries and keys to even
blocks), everything each device computes itself, replicated work included (AdaLN modulation, FLUX's
conditioning embedders, Wan's text embedding and its cross-attention text K/V on every sequence shard).
"""

from __future__ import annotations

import dataclasses
import math

from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.local_attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jaxdit.plan.workload import Workload

#: FLUX and Wan sinusoidal time/guidance embedding width.
FREQ_DIM = 256
#: Wan 2.1 I2V CLIP feature width.
CLIP_DIM = 1280
#: Bytes per element of the dtypes the programs move.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def wire_bytes(dtype: str, cpu: bool = False) -> int:
    """Bytes per element a collective of ``dtype`` moves; the CPU backend carries bf16 as f32."""
    if cpu and dtype == "bfloat16":
        return 4
    return ITEMSIZE[dtype]


def _tiled(n: int, block: int) -> int:
    """Length the local attention kernel computes for n tokens: ceil(n/block) even blocks, padded."""
    blocks = max(1, math.ceil(n / block))
    return blocks * math.ceil(n / blocks)


def attention_flops(batch: int, heads: int, queries: int, keys: int, head_dim: int) -> int:
    """Matmul FLOPs of one ``local_attention`` call: QK^T and PV on the padded tiles."""
    return 4 * batch * heads * _tiled(queries, DEFAULT_BLOCK_Q) * _tiled(keys, DEFAULT_BLOCK_K) * head_dim


# ----------------------------------------------------------------------------------------------------
# Collectives


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective of the step, as one device sees it.

    ``elements``: operand elements per execution (hlo_stats' ``bytes_per_device`` in elements).
    ``overlap_flops``: compute the program can hide ONE execution behind (0 = exposed).
    """

    strategy: str
    kind: str  # an hlo_stats.COLLECTIVE_KINDS entry
    what: str
    count: int
    elements: int
    dtype: str
    group: int
    overlap_flops: float = 0.0

    @property
    def overlapped(self) -> bool:
        return self.overlap_flops > 0

    def operand_bytes(self, cpu: bool = False) -> int:
        return self.elements * wire_bytes(self.dtype, cpu)

    def sent_bytes(self, cpu: bool = False) -> float:
        """Bytes leaving one device per execution (bandwidth-optimal algorithms)."""
        p, size = self.group, self.operand_bytes(cpu)
        if p <= 1:
            return 0.0
        if self.kind == "all-to-all":
            return size * (p - 1) / p
        if self.kind == "all-reduce":
            return size * 2 * (p - 1) / p
        if self.kind == "all-gather":
            return size * (p - 1)
        if self.kind == "reduce-scatter":
            return size * (p - 1) / p
        return float(size)  # collective-permute, send, broadcast

    def total_sent(self, cpu: bool = False) -> float:
        return self.count * self.sent_bytes(cpu)


# ----------------------------------------------------------------------------------------------------
# The step


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Cost of one denoising step of ``workload`` on ``config`` (per device unless named otherwise)."""

    workload: Workload
    config: ParallelConfig
    collectives: tuple[CollectiveCost, ...]
    flops: float  # matmul FLOPs of the busiest device
    summed_flops: float  # over all devices
    single_device_flops: float  # the same step on one device
    attention_flops: float  # the self-attention part of ``flops``
    param_bytes: int
    activation_bytes: int
    kv_cache_bytes: int  # PipeFusion's stale K/V (0 otherwise)
    passes: int = 1  # PipeFusion: passes a patch makes over the stages per step
    patches: int = 1  # PipeFusion: patches per step (ticks of the asynchronous pipeline)

    def bytes_sent(self, cpu: bool = False, strategy: str | None = None) -> float:
        return sum(c.total_sent(cpu) for c in self.collectives if strategy in (None, c.strategy))

    def by_kind(self, cpu: bool = False) -> dict[str, dict[str, float]]:
        """kind -> {count, bytes (operands), bytes_sent}, like ``hlo_stats.summarize``."""
        out: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0, "bytes_sent": 0.0})
            d["count"] += c.count
            d["bytes"] += c.count * c.operand_bytes(cpu)
            d["bytes_sent"] += c.total_sent(cpu)
        return out

    @property
    def duplicated_flops(self) -> float:
        """Summed per-device FLOPs over one device's, minus 1 (work more than one device computes)."""
        return self.summed_flops / self.single_device_flops - 1.0

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes + self.kv_cache_bytes


def _local(n: int, shards: int) -> int:
    """Tokens of a group of n on one of ``shards`` sequence shards (padded layout)."""
    return math.ceil(n / shards)


def _stage_layers(layers: int, stages: int) -> int:
    """Blocks of a stack on the busiest PipeFusion stage."""
    return math.ceil(layers / stages)


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """Per-device sizes of the step under a config."""

    b: int  # samples per device
    seq_shards: int
    local: tuple[int, ...]  # local tokens per self-attention group
    e_t: int  # hidden features per tensor shard (whole heads)
    f_t: int  # MLP features per tensor shard
    h_t: int  # heads per tensor shard

    @property
    def n(self) -> int:
        return sum(self.local)


def _shapes(w: Workload, c: ParallelConfig) -> _Shapes:
    s = c.sequence_degree
    return _Shapes(
        b=w.batch // (c.data * c.cfg),
        seq_shards=s,
        local=tuple(_local(t, s) for t in w.tokens),
        e_t=math.ceil(w.hidden / c.tensor),
        f_t=math.ceil(w.mlp_hidden / c.tensor),
        h_t=w.num_heads // c.tensor,
    )


def _self_attention_flops(w: Workload, c: ParallelConfig, sh: _Shapes) -> int:
    """One attention layer: U gathers n U tokens for H/(U T) heads; R ring hops of that block."""
    gathered = sh.n * c.ulysses
    heads = sh.h_t // c.ulysses
    return c.ring * attention_flops(sh.b, heads, gathered, gathered, w.head_dim)


# ------------------------------------------------------------------ FLUX


def _flux_flops(w: Workload, c: ParallelConfig) -> tuple[float, float, float, float]:
    """(non-block, per double block, per single block, per-layer self-attention) FLOPs per device."""
    m, sh = w.model, _shapes(w, c)
    e, b, n = w.hidden, sh.b, sh.n
    n_txt, n_img = sh.local
    vec = 2 * b * (FREQ_DIM * e + e * e) + 2 * b * (m.vec_in_dim * e + e * e)  # time_in, vector_in
    if m.guidance_embed:
        vec += 2 * b * (FREQ_DIM * e + e * e)
    nonblock = (
        vec
        + 2 * b * n_img * m.in_channels * e  # img_in
        + 2 * b * n_txt * m.context_in_dim * e  # txt_in
        + 2 * b * e * 2 * e  # final adaLN (replicated)
        + 2 * b * n_img * e * m.out_channels  # final linear
    )
    att = _self_attention_flops(w, c, sh)
    qkv_proj = 2 * b * n * e * sh.e_t * 4  # q, k, v, out projections (txt and img streams together)
    mlp = 2 * b * n * e * sh.f_t * 2
    double = 2 * (2 * b * e * 6 * e) + qkv_proj + mlp + att  # two streams' 6E modulation, replicated
    single = 2 * b * e * 3 * e + qkv_proj + mlp + att  # mlp_in, linear2's MLP half
    return nonblock, double, single, att


def _flux_params(w: Workload, c: ParallelConfig) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(non-block bytes, ((layers, bytes per block) per stack)) on one device."""
    m, e, f, d = w.model, w.hidden, w.mlp_hidden, w.head_dim
    e_t, f_t = math.ceil(e / c.tensor), math.ceil(f / c.tensor)
    embed = lambda d_in: d_in * e + e + e * e + e  # MLPEmbedder: Linear(d_in, E) -> Linear(E, E)
    nonblock = (
        m.in_channels * e
        + e
        + m.context_in_dim * e
        + e
        + embed(FREQ_DIM)
        + embed(m.vec_in_dim)
        + (embed(FREQ_DIM) if m.guidance_embed else 0)
        + e * 2 * e
        + 2 * e  # final adaLN
        + e * m.out_channels
        + m.out_channels
    )
    # Column-parallel q/k/v (+bias) and MLP-in (+bias), row-parallel out projections (bias replicated);
    # modulation and QK-norm scales replicated.
    qkv = 3 * (e * e_t + e_t) + 2 * d
    stream = (e * 6 * e + 6 * e) + qkv + (e_t * e + e) + (e * f_t + f_t) + (f_t * e + e)
    single = (e * 3 * e + 3 * e) + qkv + (e * f_t + f_t) + (e_t * e + e) + f_t * e
    a = w.itemsize
    return nonblock * a, ((m.depth, 2 * stream * a), (m.depth_single_blocks, single * a))


# ------------------------------------------------------------------- Wan


def _wan_flops(w: Workload, c: ParallelConfig) -> tuple[float, float, float]:
    """(non-block, per block, per-layer self-attention) FLOPs per device."""
    m, sh = w.model, _shapes(w, c)
    e, b, n = w.hidden, sh.b, sh.n
    text = w.context[0]
    nonblock = (
        2 * b * n * m.patch_features * e  # patch embedding
        + 2 * b * text * (m.text_dim * e + e * e)  # text embedding: every shard embeds the whole prompt
        + 2 * b * (m.freq_dim * e + e * e)  # time embedding
        + 2 * b * e * 6 * e  # time projection
        + 2 * b * n * e * m.out_features  # head
    )
    att = _self_attention_flops(w, c, sh)
    block = (
        2 * b * n * e * sh.e_t * 4  # self-attention q, k, v, o
        + att
        + 2 * b * n * e * sh.e_t * 2  # cross-attention q, o
        + 2 * b * text * e * sh.e_t * 2  # cross-attention text k, v: on every sequence shard
        + attention_flops(b, sh.h_t, n, text, w.head_dim)
        + 2 * b * n * e * sh.f_t * 2  # FFN
    )
    if m.is_i2v:
        image = w.context[1]
        nonblock += 2 * b * image * (CLIP_DIM * CLIP_DIM + CLIP_DIM * e)
        block += 2 * b * image * e * sh.e_t * 2 + attention_flops(b, sh.h_t, n, image, w.head_dim)
    return nonblock, block, att


def _wan_params(w: Workload, c: ParallelConfig) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(non-block bytes, ((layers, bytes per block),)) on one device."""
    m, e, f = w.model, w.hidden, w.mlp_hidden
    e_t, f_t = math.ceil(e / c.tensor), math.ceil(f / c.tensor)
    a = w.itemsize  # matmul weights in the model dtype; norms, modulation, time path in fp32
    nonblock = (
        (m.patch_features * e + e) * a
        + (m.text_dim * e + e + e * e + e) * a
        + (m.freq_dim * e + e + e * e + e + e * 6 * e + 6 * e) * 4  # time embedding + projection
        + 2 * e * 4  # head modulation
        + (e * m.out_features + m.out_features) * a
    )
    attn = 3 * (e * e_t + e_t) + e_t * e + e  # q, k, v column-parallel, o row-parallel (bias replicated)
    block = (
        6 * e * 4  # modulation
        + attn * a
        + 2 * e_t * 4  # self-attention q/k RMSNorm weights ("heads": split over tensor)
        + 2 * e * 4  # cross-attention LayerNorm
        + attn * a
        + 2 * e_t * 4
        + (e * f_t + f_t + f_t * e + e) * a
    )
    if m.is_i2v:
        nonblock += 2 * CLIP_DIM * 4 + (CLIP_DIM * CLIP_DIM + CLIP_DIM + CLIP_DIM * e + e) * a + 2 * e * 4
        block += 2 * (e * e_t + e_t) * a + e_t * 4
    return nonblock, ((m.num_layers, block),)


# ----------------------------------------------------------------------------- memory


def _tile(n: int, block: int) -> int:
    """Size of one of the local kernel's blocks over n tokens."""
    return math.ceil(n / max(1, math.ceil(n / block)))


def _activation_bytes(w: Workload, c: ParallelConfig, block_weights: int) -> int:
    """Working memory of the busiest device inside one block (inference keeps nothing across blocks).

    ``block_weights``: the largest block's weights on this device. The layers are a ``lax.scan`` over
    stacked weights and XLA copies the running layer's slice out of the stack (measured on CPU; a GPU
    GEMM also needs its operand in a buffer of its own). Then the fp32 residual stream in and out of the
    block, and the larger of two phases: attention (the normed input, q/k/v before and after Ulysses'
    exchange, ring's K/V block in flight and its merged output, the kernel's fp32 output accumulator and
    one fp32 score tile with its probabilities) and the MLP (its hidden layer in fp32 and in the model dtype, and the fp32
    partial sum). Wan adds the embedded context and its K/V. Under PipeFusion a tick works on one
    patch (1/M of the tokens); its stale K/V is :func:`_kv_cache_bytes`.
    """
    sh, a, e = _shapes(w, c), w.itemsize, w.hidden
    b, n = sh.b, sh.n
    if c.pipefusion > 1:
        n = math.ceil(n / pipeline_shape(w, c)[1])  # a tick works on one patch
    residual = 2 * b * n * e * 4
    gathered = n * c.ulysses
    heads = sh.h_t // c.ulysses
    tq, tk = _tile(gathered, DEFAULT_BLOCK_Q), _tile(gathered, DEFAULT_BLOCK_K)
    qkv = 3 * b * n * sh.e_t * a
    attention = (
        b * n * e * a  # normed block input
        + qkv * (2 if c.ulysses > 1 else 1)
        + (2 * b * n * sh.e_t * a if c.ring > 1 else 0)  # the K/V block in flight
        # fp32 output accumulator; ring also keeps the merged output of the hops before
        + b * gathered * heads * w.head_dim * 4 * (2 if c.ring > 1 else 1)
        + 2 * b * heads * tq * tk * 4  # one score tile and its probabilities
    )
    mlp = b * n * sh.f_t * (4 + a) + b * n * e * 4
    context = 0
    if w.family == "wan":
        ctx = sum(w.context)
        context = b * ctx * e * a + 2 * b * ctx * sh.e_t * a
    return block_weights + residual + max(attention, mlp) + context


def _kv_cache_bytes(w: Workload, c: ParallelConfig) -> int:
    """PipeFusion: each stage keeps every token's K and V of its own attention layers (its heads)."""
    if c.pipefusion == 1:
        return 0
    sh = _shapes(w, c)
    if w.family == "flux":
        layers = _stage_layers(w.model.depth, c.pipefusion) + _stage_layers(
            w.model.depth_single_blocks, c.pipefusion
        )
    else:
        layers = _stage_layers(w.model.num_layers, c.pipefusion)
    return layers * 2 * sh.b * sh.n * sh.e_t * w.itemsize


# --------------------------------------------------------------------------- the model


def _collectives(
    w: Workload, c: ParallelConfig, attention_layers: int, att_flops: float, device_flops: float
) -> list[CollectiveCost]:
    sh = _shapes(w, c)
    b, n, e, act = sh.b, sh.n, w.hidden, w.dtype
    block = b * n * sh.h_t * w.head_dim  # one of q, k, v, out on this device
    out: list[CollectiveCost] = []
    if c.ulysses > 1:
        out.append(
            CollectiveCost(
                "ulysses",
                "all-to-all",
                "q, k, v and output of every attention layer",
                4 * attention_layers,
                block,
                act,
                c.ulysses,
            )
        )
    if c.ring > 1:
        # Each hop's K and V permutes overlap the local attention of the block in hand (1/R of it).
        out.append(
            CollectiveCost(
                "ring",
                "collective-permute",
                "K and V blocks, R-1 hops per attention layer",
                2 * (c.ring - 1) * attention_layers,
                block,
                act,
                c.ring,
                overlap_flops=att_flops / c.ring / 2,
            )
        )
    if c.tensor > 1:
        p = c.pipefusion
        if w.family == "flux":
            n_txt, n_img = sh.local
            double = _stage_layers(w.model.depth, p)
            single = _stage_layers(w.model.depth_single_blocks, p)
            for tokens, what in ((n_txt, "text"), (n_img, "image")):
                out.append(
                    CollectiveCost(
                        "tensor",
                        "all-reduce",
                        f"double blocks, {what} stream: attention-out and MLP-down partial sums",
                        2 * double,
                        b * tokens * e,
                        "float32",
                        c.tensor,
                    )
                )
            out.append(
                CollectiveCost(
                    "tensor",
                    "all-reduce",
                    "single blocks: linear2 partial sums ([attention | MLP] in one)",
                    single,
                    b * n * e,
                    "float32",
                    c.tensor,
                )
            )
        else:
            layers = _stage_layers(w.model.num_layers, p)
            out.append(
                CollectiveCost(
                    "tensor",
                    "all-reduce",
                    "self-attention o, cross-attention o, FFN-down partial sums",
                    3 * layers,
                    b * n * e,
                    "float32",
                    c.tensor,
                )
            )
            out.append(
                CollectiveCost(
                    "tensor",
                    "all-reduce",
                    "RMSNorm sums of squares across heads: self q, k",
                    layers,
                    b * 2 * n,
                    "float32",
                    c.tensor,
                )
            )
            out.append(
                CollectiveCost(
                    "tensor",
                    "all-reduce",
                    "RMSNorm sums of squares across heads: cross q, context k",
                    layers,
                    b * (n + sum(w.context)),
                    "float32",
                    c.tensor,
                )
            )
    if c.cfg > 1:
        pred_dtype = w.dtype if w.family == "flux" else "float32"  # Wan's head returns fp32
        out.append(
            CollectiveCost(
                "cfg",
                "collective-permute",
                "this device's share of its branch's noise prediction, once per step",
                1,
                b * sh.local[-1] * w.output_features,
                pred_dtype,
                2,
            )
        )
    if c.pipefusion > 1:
        passes, patches = pipeline_shape(w, c)
        out.append(
            CollectiveCost(
                "pipefusion",
                "collective-permute",
                f"one patch's fp32 activations to the neighbouring stage, {passes} per tick",
                passes * patches,
                b * math.ceil(n / patches) * e,
                "float32",
                c.pipefusion,
                overlap_flops=device_flops / (patches * passes),  # the tick's compute
            )
        )
        if w.family == "wan":
            # Wan's one pass ends on the last stage, which runs the sampler: the updated latent patch
            # (fp32, one per request, no CFG branches) goes back to stage 0 once per tick.
            out.append(
                CollectiveCost(
                    "pipefusion",
                    "collective-permute",
                    "the updated fp32 latent patch from the last stage to stage 0, one per tick",
                    patches,
                    w.requests // c.data * math.ceil(n / patches) * w.output_features,
                    "float32",
                    c.pipefusion,
                    overlap_flops=device_flops / patches,
                )
            )
    return out


def pipeline_shape(w: Workload, c: ParallelConfig) -> tuple[int, int]:
    """PipeFusion's (passes V, patches M): a pass per stack of blocks, M = V x P (a full pipeline)."""
    passes = 2 if w.family == "flux" else 1
    return passes, passes * c.pipefusion


def step_cost(w: Workload, c: ParallelConfig) -> StepCost:
    """The analytic cost of one denoising step of ``w`` on ``c`` (see the module docstring)."""
    p = c.pipefusion
    if w.family == "flux":
        nonblock, double, single, att = _flux_flops(w, c)
        stacks = ((w.model.depth, double), (w.model.depth_single_blocks, single))
        param_nonblock, param_stacks = _flux_params(w, c)
    else:
        nonblock, block, att = _wan_flops(w, c)
        stacks = ((w.model.num_layers, block),)
        param_nonblock, param_stacks = _wan_params(w, c)
    params = param_nonblock + sum(_stage_layers(layers, p) * b for layers, b in param_stacks)
    block_weights = max(b for layers, b in param_stacks if layers)
    busiest = nonblock + sum(_stage_layers(layers, p) * f for layers, f in stacks)
    # Stages differ only in how many blocks they hold: summed over devices, every block once per
    # (data, cfg, sequence, tensor) position and the non-block work on every device.
    summed = c.num_devices * nonblock + (c.num_devices // p) * sum(layers * f for layers, f in stacks)
    attention_layers = sum(_stage_layers(layers, p) for layers, _ in stacks)
    single_cfg = ParallelConfig()
    if w.family == "flux":
        s_nonblock, s_double, s_single, _ = _flux_flops(w, single_cfg)
        single_flops = s_nonblock + w.model.depth * s_double + w.model.depth_single_blocks * s_single
    else:
        s_nonblock, s_block, _ = _wan_flops(w, single_cfg)
        single_flops = s_nonblock + w.model.num_layers * s_block
    return StepCost(
        workload=w,
        config=c,
        collectives=tuple(_collectives(w, c, attention_layers, att, busiest)),
        flops=float(busiest),
        summed_flops=float(summed),
        single_device_flops=float(single_flops),
        attention_flops=float(attention_layers * att),
        param_bytes=params,
        activation_bytes=_activation_bytes(w, c, block_weights),
        kv_cache_bytes=_kv_cache_bytes(w, c),
        passes=pipeline_shape(w, c)[0] if p > 1 else 1,
        patches=pipeline_shape(w, c)[1] if p > 1 else 1,
    )


def pipefusion_programs(
    w: Workload, c: ParallelConfig, warmup_steps: int = 1, cpu: bool = False
) -> dict[str, float]:
    """PipeFusion's bytes sent per device, per program, as the runner splits a generation: ``warmup``
    (one synchronous step: the full sequence through all P stages, so every stage's Ulysses / Ring /
    tensor collectives run P times, 2(P-1) hops of the full fp32 sequence, CFG's exchange once) and
    ``pipelined`` (the S-W asynchronous steps as one scan of ``ticks`` ticks, bubbles included: every tick
    runs both passes on one patch, i.e. 1/M of a step's sequence collectives, two activation hops and
    1/M of CFG's exchange). ``steady_step`` is M ticks (what :func:`step_cost` prices per step). The
    per-step terms are :func:`step_cost`'s; ``generation`` is W warm-up steps plus the pipelined phase."""
    if c.pipefusion == 1:
        raise ValueError("pipefusion_programs needs pipefusion > 1")
    passes, patches = pipeline_shape(w, c)
    cost = step_cost(w, c)
    sequence = sum(x.total_sent(cpu) for x in cost.collectives if x.strategy in ("ulysses", "ring", "tensor"))
    cfg = sum(x.total_sent(cpu) for x in cost.collectives if x.strategy == "cfg")
    act, *latent = [x.sent_bytes(cpu) for x in cost.collectives if x.strategy == "pipefusion"]  # one patch
    latent = sum(latent)  # Wan: the latent patch back to stage 0 (FLUX's V shape ends on stage 0)
    p = c.pipefusion
    rest = w.steps - warmup_steps
    depth = passes * p
    ticks = (rest - 1) * max(patches, depth) + patches - 1 + depth if rest > 0 else 0
    tick = sequence / patches + passes * act + latent + cfg / patches
    warmup = p * sequence + passes * (p - 1) * patches * act + patches * latent + cfg
    return {
        "warmup": warmup,
        "pipelined": ticks * tick,
        "ticks": ticks,
        "tick": tick,
        "steady_step": patches * tick,
        "patches": patches,
        "generation": warmup_steps * warmup + ticks * tick,
    }
