"""The analytic cost of one denoising step on a :class:`ParallelConfig`: bytes each device sends, FLOPs,
parameter and activation memory per device. docs/parallelism.md writes every formula out.

Everything is per device and per denoising step, and follows what jaxdit's programs do (each term says
which code it models), so that ``jaxdit plan --verify`` can hold it against the compiled HLO:

- Ulysses (``parallel/ulysses.py``): 4 all-to-alls per attention layer (q, k, v, output), each of the
  local [b, n, H/T, D] block; (U-1)/U of it leaves the device.
- Ring (``parallel/ring.py``): R-1 hops, each a collective-permute of K and one of V (the same block
  size: after Ulysses a ring member holds U shards' tokens for H/(U T) heads); overlapped with the
  local attention of the block in hand.
- Tensor (Megatron): one fp32 all-reduce of the partial sums after each row-parallel projection, plus
  whatever else a family's blocks reduce (Wan's per-token sums of squares for its q/k RMSNorm across
  all heads): each family lists them in its ``step_terms`` (``jaxdit/families/<family>.py``).
- CFG (``parallel/cfg.py``): one collective-permute of this device's share of one noise prediction per
  step, in the dtype the family's head predicts in.
- PipeFusion (``pipelines/pipefusion/programs.py``): each stack of blocks is split over the P stages
  (ceil(L/P) blocks of every stack per device) and the latent into M patches; a patch makes V passes
  over the stages (one per stack; FLUX: double blocks up, single blocks back down, V=2; Wan: V=1), so
  per tick each device sends V collective-permutes of one patch's fp32 residual stream, overlapped with
  the tick's compute; an odd V ends on the last stage, which also sends the updated fp32 latent patch
  back to stage 0 each tick (the predicted group's tokens of the patch). M = V x P keeps the pipeline
  full: the plan's M, unless the family's runner takes another by default
  (``ModelFamily.pipefusion_patches``: Z-Image's M >= 3P dividing the rows). Stale K/V never leaves its
  device but costs memory.
- fsdp (``parallel/fsdp.py``, ``plan/fsdp.py``): per stack of n layers on a device, every split block
  parameter all-gathered n + 1 times per forward (each layer one iteration ahead, plus the prefetch of
  layer 0; a one-layer stack once), overlapped with the previous layer; under PipeFusion n per tick and
  the prefetch once per program. The weights outside the stacks are gathered once per compiled step.
  The stored shares are parameters; two gathered layers and the gathered rest are working memory.
- Data: nothing.

The family-specific arithmetic (FLOPs of its blocks, parameter bytes, its all-reduces, its context's
memory) comes from the family object (:meth:`jaxdit.families.base.ModelFamily.step_terms`); this module
adds the strategies' collectives, memory and the PipeFusion schedule, for any family.

Bytes follow ``jaxdit.hlo_stats`` conventions (``bytes_sent``: all-to-all (P-1)/P of the operand,
collective-permute the operand, all-reduce 2(P-1)/P of it). ``cpu=True`` prices bf16 collectives at 4
bytes per element, as XLA's CPU backend carries them in f32 (measured: ``tests/test_hlo_stats.py``);
fp32 ones are unchanged.

FLOPs count matmuls (dots) only, like ``hlo_stats.flops_per_device``: 2 per multiply-add, attention on the
tiles the local kernel really computes (``parallel/local_attention.py`` pads queries and keys to even
blocks), everything each device computes itself, replicated work included.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdit.families.base import StepTerms
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.flops import attention_flops
from jaxdit.parallel.fsdp import fsdp_axes
from jaxdit.parallel.local_attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jaxdit.plan.fp8 import fp8_block_saving
from jaxdit.plan.fsdp import fsdp_rest, fsdp_stacks
from jaxdit.plan.workload import Workload

__all__ = [
    "CollectiveCost",
    "Shapes",
    "StepCost",
    "attention_flops",
    "pipefusion_programs",
    "shapes",
    "step_cost",
]

#: Bytes per element of the dtypes the programs move.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "bool": 1, "float8_e4m3fn": 1}


def wire_bytes(dtype: str, cpu: bool = False) -> int:
    """Bytes per element a collective of ``dtype`` moves; the CPU backend carries bf16 as f32 and FP8 in
    two bytes (measured: fsdp's gathers of FP8 weights, tests/test_fsdp.py)."""
    if cpu and dtype == "bfloat16":
        return 4
    if cpu and dtype.startswith("float8"):
        return 2
    return ITEMSIZE[dtype]


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
    param_bytes: int  # the parameters one step reads (one expert's)
    activation_bytes: int
    kv_cache_bytes: int  # PipeFusion's stale K/V (0 otherwise)
    idle_expert_bytes: int = 0  # the other resident experts' parameters (Wan 2.2 A14B, not offloaded)
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
    def resident_param_bytes(self) -> int:
        """Parameters on each device: the step's plus the idle resident experts'."""
        return self.param_bytes + self.idle_expert_bytes

    @property
    def memory_bytes(self) -> int:
        return self.resident_param_bytes + self.activation_bytes + self.kv_cache_bytes


def _local(n: int, shards: int) -> int:
    """Tokens of a group of n on one of ``shards`` sequence shards (padded layout)."""
    return math.ceil(n / shards)


def _stage_layers(layers: int, stages: int) -> int:
    """Blocks of a stack on the busiest PipeFusion stage."""
    return math.ceil(layers / stages)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-device sizes of the step under a config (what a family's ``step_terms`` computes from)."""

    b: int  # samples per device
    seq_shards: int
    local: tuple[int, ...]  # local tokens per self-attention group
    e_t: int  # hidden features per tensor shard (whole heads)
    f_t: int  # MLP features per tensor shard
    h_t: int  # heads per tensor shard
    #: One self-attention layer: U gathers n U tokens for H/(U T) heads; R ring hops of that block.
    self_attention_flops: int

    @property
    def n(self) -> int:
        return sum(self.local)


def shapes(w: Workload, c: ParallelConfig) -> Shapes:
    s = c.sequence_degree
    b, h_t = w.batch // (c.data * c.cfg), w.num_heads // c.tensor
    # PipeFusion: the groups as its runner pads them per patch (ModelFamily.pipefusion_tokens).
    tokens = w.family.pipefusion_tokens(w, c) if c.pipefusion > 1 else w.tokens
    local = tuple(_local(t, s) for t in tokens)
    gathered = sum(local) * c.ulysses
    return Shapes(
        b=b,
        seq_shards=s,
        local=local,
        e_t=math.ceil(w.hidden / c.tensor),
        f_t=math.ceil(w.mlp_hidden / c.tensor),
        h_t=h_t,
        self_attention_flops=c.ring * attention_flops(b, h_t // c.ulysses, gathered, gathered, w.head_dim),
    )


# ----------------------------------------------------------------------------- memory


def _tile(n: int, block: int) -> int:
    """Size of one of the local kernel's blocks over n tokens."""
    return math.ceil(n / max(1, math.ceil(n / block)))


def _activation_bytes(
    w: Workload, c: ParallelConfig, block_weights: int, context_bytes: int, fsdp_slice: int = 0
) -> int:
    """Working memory of the busiest device inside one block (inference keeps nothing across blocks).

    ``block_weights``: the largest block's weights on this device. The layers are a ``lax.scan`` over
    stacked weights and XLA copies the running layer's slice out of the stack (measured on CPU; a GPU
    GEMM also needs its operand in a buffer of its own). Then the fp32 residual stream in and out of the
    block, and the larger of two phases: attention (the normed input, q/k/v before and after Ulysses'
    exchange, ring's K/V block in flight and its merged output, the kernel's fp32 output accumulator and
    one fp32 score tile with its probabilities) and the MLP (its hidden layer in fp32 and in the model dtype, and the fp32
    partial sum). Cross-attention adds the embedded context and its K/V (the family's ``context_bytes``).
    Under PipeFusion a tick works on one patch (1/M of the tokens); its stale K/V is
    :func:`_kv_cache_bytes`. Under fsdp (``fsdp_slice``: the largest block's local shard) the scan
    copies the shard out of the stack and holds two gathered layers, the running one and the next.
    """
    sh, a, e = shapes(w, c), w.itemsize, w.hidden
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
    weights = 2 * block_weights + fsdp_slice if fsdp_slice else block_weights
    return weights + residual + max(attention, mlp) + context_bytes


def _kv_cache_bytes(w: Workload, c: ParallelConfig) -> int:
    """PipeFusion: each stage keeps every token's K and V of its own attention layers (its heads)."""
    if c.pipefusion == 1:
        return 0
    sh = shapes(w, c)
    layers = sum(_stage_layers(depth, c.pipefusion) for depth in w.stack_depths)
    return layers * 2 * sh.b * sh.n * sh.e_t * w.itemsize


# --------------------------------------------------------------------------- the model


def _collectives(
    w: Workload, c: ParallelConfig, terms: StepTerms, attention_layers: int, device_flops: float
) -> list[CollectiveCost]:
    sh = shapes(w, c)
    b, n, e, act = sh.b, sh.n, w.hidden, w.dtype
    out: list[CollectiveCost] = []
    # Attention layers by the tokens they cover (one entry, all n tokens, unless a stack attends over
    # fewer: ``StepTerms.attention_tokens``).
    layers_by_tokens: dict[int, int] = {}
    if terms.attention_tokens:
        for depth, tokens in zip(w.stack_depths, terms.attention_tokens, strict=True):
            layers = _stage_layers(depth, c.pipefusion)
            if layers:
                layers_by_tokens[tokens] = layers_by_tokens.get(tokens, 0) + layers
    else:
        layers_by_tokens[n] = attention_layers
    for tokens, layers in layers_by_tokens.items():
        block = b * tokens * sh.h_t * w.head_dim  # one of q, k, v, out on this device
        which = "" if tokens == n else f" over {tokens} of the {n} tokens"
        if c.ulysses > 1:
            out.append(
                CollectiveCost(
                    "ulysses",
                    "all-to-all",
                    f"q, k, v and output of every attention layer{which}",
                    4 * layers,
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
                    f"K and V blocks, R-1 hops per attention layer{which}",
                    2 * (c.ring - 1) * layers,
                    block,
                    act,
                    c.ring,
                    overlap_flops=terms.attention_flops / c.ring / 2,
                )
            )
    if terms.masked_keys and c.sequence_degree > 1 and c.pipefusion == 1:
        # PipeFusion's programs take the mask replicated over the sequence axes instead (no gather).
        out.append(
            CollectiveCost(
                "ulysses" if c.ulysses > 1 else "ring",
                "all-gather",
                "the prompts' key mask over the sequence shards, once per forward",
                1,
                b * n,
                "bool",
                c.sequence_degree,
            )
        )
    if c.tensor > 1:
        for r in terms.reductions:
            layers = _stage_layers(w.stack_depths[r.stack], c.pipefusion)
            out.append(
                CollectiveCost(
                    "tensor", "all-reduce", r.what, r.per_block * layers, r.elements, "float32", c.tensor
                )
            )
    if c.cfg > 1:
        out.append(
            CollectiveCost(
                "cfg",
                "collective-permute",
                "this device's share of its branch's noise prediction, once per step",
                1,
                b * sh.local[w.family.prediction_group] * w.output_features,
                w.family.prediction_dtype(w.dtype),
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
        if passes % 2:
            # An odd number of passes ends on the last stage, which runs the sampler: the updated latent
            # patch (fp32, one per request, no CFG branches; the predicted group's tokens of the patch)
            # goes back to stage 0 once per tick.
            latent = math.ceil(sh.local[w.family.prediction_group] / patches)
            out.append(
                CollectiveCost(
                    "pipefusion",
                    "collective-permute",
                    "the updated fp32 latent patch from the last stage to stage 0, one per tick",
                    patches,
                    w.requests // c.data * latent * w.output_features,
                    "float32",
                    c.pipefusion,
                    overlap_flops=device_flops / patches,
                )
            )
    return out


def fsdp_layer_gathers(n: int, pipefusion: bool) -> tuple[int, int]:
    """(gathers per forward, gathers once per program) of each split parameter of a stack of ``n``
    layers on a device, as compiled (``jaxdit.parallel.fsdp.gathered_scan``): the scan's body gathers
    layer ``i + 1 mod n`` while layer ``i`` runs (``n`` per forward) after a prefetch of layer 0. The
    prefetch depends on nothing the step computes: in PipeFusion's programs XLA hoists it out of the
    tick loop (and merges the warm-up's P copies), so it runs once per program. A one-layer scan is no
    loop: its one gather is the prefetch's (once per forward; PipeFusion: once per program)."""
    if n == 1:
        return (0, 1) if pipefusion else (1, 0)
    return (n, 1) if pipefusion else (n + 1, 0)


def _fsdp_gathers(
    w: Workload, c: ParallelConfig, stacks: tuple, flops: tuple[tuple[int, float], ...]
) -> tuple[CollectiveCost, ...]:
    """fsdp's all-gathers of one step (:func:`fsdp_layer_gathers`): per forward on a plain mesh, per tick
    under PipeFusion (M per step; the once-per-program prefetch is in :func:`pipefusion_programs`). A
    layer's gathers overlap the previous layer's compute (shared by their bytes)."""
    if not stacks:
        return ()
    out = []
    patches = pipeline_shape(w, c)[1] if c.pipefusion > 1 else 1
    for stack, (layers, block_flops) in zip(stacks, flops, strict=True):
        if stack is None or not layers:
            continue
        n = _stage_layers(layers, c.pipefusion)
        per_forward, _ = fsdp_layer_gathers(n, c.pipefusion > 1)
        total = sum(e * ITEMSIZE[d] * k for (e, d, _), k in stack.gathers)
        for (elements, dtype, group), k in stack.gathers:
            if not per_forward:
                continue
            share = elements * ITEMSIZE[dtype] / total
            out.append(
                CollectiveCost(
                    "fsdp",
                    "all-gather",
                    f"{k} block weights of {elements} elements each, gathered a layer ahead",
                    k * per_forward * patches,
                    elements,
                    dtype,
                    group,
                    overlap_flops=block_flops / patches * share,
                )
            )
    if c.pipefusion == 1:  # PipeFusion's programs gather them once each (pipefusion_programs)
        rest = fsdp_rest(w.family, w.model, w.dtype, w.fp8, c)
        for (elements, dtype, group), k in rest.gathers:
            what = f"{k} weights outside the blocks of {elements} elements each, gathered for the step"
            out.append(CollectiveCost("fsdp", "all-gather", what, k, elements, dtype, group))
    return tuple(out)


def _fsdp_prefetch_bytes(w: Workload, c: ParallelConfig, cpu: bool) -> float:
    """PipeFusion: bytes one device sends for what each program gathers once: the stacks' prefetches and
    the weights outside the blocks."""
    if not fsdp_axes(c):
        return 0.0
    stacks = fsdp_stacks(w.family, w.model, w.dtype, w.fp8, c)
    rest = fsdp_rest(w.family, w.model, w.dtype, w.fp8, c)
    total = sum(
        k * CollectiveCost("fsdp", "all-gather", "", 1, e, d, g).sent_bytes(cpu)
        for (e, d, g), k in rest.gathers
    )
    for stack, layers in zip(stacks, w.stack_depths, strict=True):
        if stack is None or not layers:
            continue
        _, once = fsdp_layer_gathers(_stage_layers(layers, c.pipefusion), True)
        for (elements, dtype, group), k in stack.gathers:
            total += (
                once * k * CollectiveCost("fsdp", "all-gather", "", 1, elements, dtype, group).sent_bytes(cpu)
            )
    return total


def pipeline_shape(w: Workload, c: ParallelConfig) -> tuple[int, int]:
    """PipeFusion's (passes V, patches M): a pass per stack of blocks; M the family's
    (``ModelFamily.pipefusion_patches``: V x P, a full pipeline, unless its runner picks another)."""
    return len(w.stack_depths), w.family.pipefusion_patches(w, c)


def fsdp_ways(c: ParallelConfig) -> int:
    """How many ways fsdp splits a block's weights beyond tensor and PipeFusion (1 without fsdp)."""
    return math.prod(c.degrees[a] for a in fsdp_axes(c) if a not in ("tensor", "pipefusion"))


def step_cost(w: Workload, c: ParallelConfig) -> StepCost:
    """The analytic cost of one denoising step of ``w`` on ``c`` (see the module docstring)."""
    p = c.pipefusion
    terms = w.family.step_terms(w, c, shapes(w, c))
    stacks = tuple(zip(w.stack_depths, terms.block_flops, strict=True))
    block_bytes = terms.param_block_bytes
    if w.fp8:
        saving = fp8_block_saving(w.family, w.model, w.dtype, c.tensor)
        block_bytes = tuple(b - s for b, s in zip(block_bytes, saving, strict=True))
    block_weights = max(b for layers, b in zip(w.stack_depths, block_bytes, strict=True) if layers)
    resident = block_bytes
    gathers: tuple = ()
    nonblock, gathered_rest = terms.param_nonblock_bytes, 0
    if fsdp_axes(c):
        # fsdp: each device keeps its share of every block of its stage (exactly as shard_stacks splits
        # them), and holds the running layer and the next one's prefetch gathered (jaxdit.parallel.fsdp):
        # working memory (_activation_bytes), not stored parameters.
        # The weights outside the blocks are stored split too and gathered whole for the step (shard_rest).
        gathers = fsdp_stacks(w.family, w.model, w.dtype, w.fp8, c)
        rest = fsdp_rest(w.family, w.model, w.dtype, w.fp8, c)
        resident = tuple(0 if s is None else s.resident for s in gathers)
        block_weights = max(s.gathered for s in gathers if s is not None)
        nonblock = terms.param_nonblock_bytes - rest.gathered + rest.resident
        gathered_rest = rest.gathered
    params = nonblock + sum(
        _stage_layers(layers, p) * b for layers, b in zip(w.stack_depths, resident, strict=True)
    )
    busiest = terms.nonblock_flops + sum(_stage_layers(layers, p) * f for layers, f in stacks)
    # Stages differ only in how many blocks they hold: summed over devices, every block once per
    # (data, cfg, sequence, tensor) position and the non-block work on every device.
    summed = c.num_devices * terms.nonblock_flops + (c.num_devices // p) * sum(
        layers * f for layers, f in stacks
    )
    if w.fp8_retained:
        # The FP8 weights plus their layers' originals (the other weights are one array shared by both).
        # FP8 saves (b - 1) of every b bytes of an element stored in b-byte floats, less the scales, so the
        # originals are b / (b - 1) x the saving: exact to the scales' bytes (one fp32 per output channel).
        plain = step_cost(dataclasses.replace(w, fp8=False, fp8_retained=False), c).param_bytes
        b = w.itemsize
        params += (plain - params) * b // (b - 1)
    attention_layers = sum(_stage_layers(layers, p) for layers, _ in stacks)
    single_cfg = ParallelConfig()
    single = w.family.step_terms(w, single_cfg, shapes(w, single_cfg))
    single_flops = single.nonblock_flops + sum(
        layers * f for layers, f in zip(w.stack_depths, single.block_flops, strict=True)
    )
    return StepCost(
        workload=w,
        config=c,
        collectives=tuple(_collectives(w, c, terms, attention_layers, busiest))
        + _fsdp_gathers(w, c, gathers, stacks),
        flops=float(busiest),
        summed_flops=float(summed),
        single_device_flops=float(single_flops),
        attention_flops=float(attention_layers * terms.attention_flops),
        param_bytes=params,
        activation_bytes=gathered_rest
        + _activation_bytes(w, c, block_weights, terms.context_bytes, max(resident) if gathers else 0),
        kv_cache_bytes=_kv_cache_bytes(w, c),
        # Every expert has the same config and shardings: the idle resident ones hold what the running
        # one does.
        idle_expert_bytes=(w.resident_experts - 1) * params,
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
    latent = sum(latent)  # odd V: the latent patch back to stage 0 (an even V shape ends on stage 0)
    p = c.pipefusion
    rest = w.steps - warmup_steps
    depth = passes * p
    ticks = (rest - 1) * max(patches, depth) + patches - 1 + depth if rest > 0 else 0
    # fsdp: each stage's layers gathered once per forward (P forwards in the warm-up step, one per tick),
    # and the prefetches once per program.
    fsdp = sum(x.total_sent(cpu) for x in cost.collectives if x.strategy == "fsdp") / patches
    once = _fsdp_prefetch_bytes(w, c, cpu)
    tick = sequence / patches + passes * act + latent + cfg / patches + fsdp
    warmup = p * sequence + passes * (p - 1) * patches * act + patches * latent + cfg + p * fsdp + once
    return {
        "warmup": warmup,
        "pipelined": ticks * tick + (once if ticks else 0),
        "ticks": ticks,
        "tick": tick,
        "steady_step": patches * tick,
        "patches": patches,
        "generation": warmup_steps * warmup + ticks * tick + (once if ticks else 0),
    }
