"""jaxdit.hlo_stats against tiny programs whose collectives, counts, bytes and FLOPs are known by hand.

Mesh (2, 4) named ('x', 'y'); every sharded input is f32[16, 32] with spec P('x', 'y'), so each device
holds f32[8, 8] = 256 bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdit import hlo_stats as hs

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
)

LOCAL = 8 * 8 * 4  # bytes of one device's f32[8, 8] block
X_PAIRS = {(0, 4), (4, 0), (1, 5), (5, 1), (2, 6), (6, 2), (3, 7), (7, 3)}  # ppermute swap over 'x'
Y_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))


def compile_sharded(mesh: Mesh, f, **kw):
    g = jax.shard_map(f, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"), **kw)
    return jax.jit(g).lower(jax.ShapeDtypeStruct((16, 32), jnp.float32)).compile()


def swap_x(v):
    return jax.lax.ppermute(v, "x", [(0, 1), (1, 0)])


def only(cs: list[hs.Collective], kind: str) -> list[hs.Collective]:
    assert {c.kind for c in cs} == {kind}, [(c.kind, c.name) for c in cs]
    return cs


def test_all_to_all_tiled(mesh):
    c = compile_sharded(mesh, lambda v: jax.lax.all_to_all(v, "y", 1, 0, tiled=True))
    cs = only(hs.collectives(c), "all-to-all")
    # CPU lowers it to ONE tuple all-to-all of 4 operands f32[8,2] (one per destination); the sum of the
    # operands is the whole local buffer either way.
    assert sum(x.count for x in cs) == 1
    (a2a,) = cs
    assert a2a.bytes_per_device == LOCAL
    assert a2a.group_size == 4 and a2a.replica_groups == Y_GROUPS
    assert a2a.bytes_sent_per_device == LOCAL * 3 / 4
    assert sum(s.nbytes for s in a2a.result_shapes) == LOCAL
    assert a2a.count_exact and a2a.trip_counts == ()
    s = hs.summarize(c)
    assert s["all-to-all"] == {"instructions": 1, "count": 1, "bytes": LOCAL, "bytes_sent": LOCAL * 3 / 4}
    assert s["total"]["count"] == 1
    assert all(s[k]["count"] == 0 for k in hs.COLLECTIVE_KINDS if k != "all-to-all")


def test_all_to_all_eight_way():
    # Eight operands: XLA's text marks the sixth with a "/*index=5*/" comment.
    mesh8 = Mesh(np.array(jax.devices()[:8]), ("u",))
    g = jax.shard_map(
        lambda v: jax.lax.all_to_all(v, "u", 1, 0, tiled=True),
        mesh=mesh8,
        in_specs=P(None, "u"),
        out_specs=P(None, "u"),
    )
    c = jax.jit(g).lower(jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile()
    (a2a,) = only(hs.collectives(c), "all-to-all")
    assert a2a.bytes_per_device == 16 * 8 * 4 and a2a.group_size == 8
    assert a2a.bytes_sent_per_device == 16 * 8 * 4 * 7 / 8


def test_ppermute(mesh):
    c = compile_sharded(mesh, swap_x)
    (p,) = only(hs.collectives(c), "collective-permute")
    assert p.count == 1
    assert p.bytes_per_device == LOCAL and p.bytes_sent_per_device == LOCAL
    assert set(p.source_target_pairs) == X_PAIRS
    assert p.group_size == 2
    assert p.operand_shapes == (hs.ArrayShape("f32", (8, 8)),)
    assert p.result_shapes == (hs.ArrayShape("f32", (8, 8)),)
    assert "ppermute" in p.op_name


def test_psum(mesh):
    c = compile_sharded(mesh, lambda v: jax.lax.psum(v, "y"))
    (r,) = only(hs.collectives(c), "all-reduce")
    assert r.count == 1 and r.group_size == 4 and r.replica_groups == Y_GROUPS
    assert r.bytes_per_device == LOCAL
    assert r.bytes_sent_per_device == 2 * LOCAL * 3 / 4


def test_all_gather_and_reduce_scatter(mesh):
    c = compile_sharded(mesh, lambda v: jax.lax.all_gather(v, "y", axis=0, tiled=True))
    (g,) = only(hs.collectives(c), "all-gather")
    assert g.bytes_per_device == LOCAL  # the shard
    assert g.result_shapes == (hs.ArrayShape("f32", (32, 8)),)
    assert g.bytes_sent_per_device == 3 * LOCAL  # (P-1)/P of the gathered result

    c = compile_sharded(mesh, lambda v: jax.lax.psum_scatter(v, "y", scatter_dimension=0, tiled=True))
    (rs,) = only(hs.collectives(c), "reduce-scatter")
    assert rs.bytes_per_device == LOCAL
    assert rs.result_shapes == (hs.ArrayShape("f32", (2, 8)),)
    assert rs.bytes_sent_per_device == LOCAL * 3 / 4


def test_scan_multiplies_by_trip_count(mesh):
    def f(v):
        return jax.lax.scan(lambda h, _: (swap_x(h) * 2, None), v, None, length=5)[0]

    c = compile_sharded(mesh, f)
    (p,) = only(hs.collectives(c), "collective-permute")
    assert p.count == 5 and p.trip_counts == (5,) and p.count_exact
    assert p.total_bytes_per_device == 5 * LOCAL
    assert hs.summarize(c)["collective-permute"]["bytes"] == 5 * LOCAL


def test_nested_scan(mesh):
    def inner(h, _):
        return swap_x(h) + 1, None

    def outer(h, _):
        h = jax.lax.scan(inner, h, None, length=4)[0]
        return h + jax.lax.psum(h, "y"), None

    c = compile_sharded(mesh, lambda v: jax.lax.scan(outer, v, None, length=3)[0])
    cs = hs.collectives(c)
    by_kind = {x.kind: x for x in cs}
    assert len(cs) == 2 and set(by_kind) == {"collective-permute", "all-reduce"}
    assert by_kind["collective-permute"].count == 12
    assert by_kind["collective-permute"].trip_counts == (3, 4)
    assert by_kind["all-reduce"].count == 3
    assert by_kind["all-reduce"].trip_counts == (3,)
    s = hs.summarize(c)
    assert s["collective-permute"]["bytes"] == 12 * LOCAL
    assert s["all-reduce"]["bytes_sent"] == 3 * 2 * LOCAL * 3 / 4
    assert s["total"] == {
        "instructions": 2,
        "count": 15,
        "bytes": 15 * LOCAL,
        "bytes_sent": 12 * LOCAL + 3 * 2 * LOCAL * 3 / 4,
    }


def test_conditional_takes_costliest_branch(mesh):
    def f(v, p):
        return jax.lax.cond(p[0] > 0, swap_x, lambda u: jax.lax.psum(u, "y"), v)

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("x", "y"), P()), out_specs=P("x", "y"), check_vma=False)
    c = jax.jit(g).lower(jnp.zeros((16, 32)), jnp.zeros((1,))).compile()
    assert " conditional(" in c.as_text()
    # Both branches move 256 operand bytes; the all-reduce sends 2*3/4*256 = 384 > 256.
    (r,) = only(hs.collectives(c), "all-reduce")
    assert r.count == 1


def test_combined_program(mesh):
    def f(v):
        v = jax.lax.all_to_all(v, "y", 1, 0, tiled=True)  # f32[32, 2]
        v = jax.lax.all_to_all(v, "y", 0, 1, tiled=True)  # back to f32[8, 8]
        v = jax.lax.scan(lambda h, _: (swap_x(h) * 2, None), v, None, length=5)[0]
        return jax.lax.psum(v, "y")

    s = hs.summarize(compile_sharded(mesh, f))
    assert s["all-to-all"]["count"] == 2 and s["all-to-all"]["bytes"] == 2 * LOCAL
    assert s["collective-permute"]["count"] == 5 and s["collective-permute"]["bytes"] == 5 * LOCAL
    assert s["all-reduce"]["count"] == 1 and s["all-reduce"]["bytes"] == LOCAL
    assert s["all-gather"]["count"] == 0
    assert s["total"]["count"] == 8


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a fact about the CPU backend")
def test_cpu_moves_bf16_collectives_as_f32(mesh):
    # jax 0.10.2 on CPU: converts bf16 -> f32 before every collective and back after it, so the bytes
    # moved are those of f32. Cost-model comparisons on CPU must compile in f32. If this fails, the
    # backend has started moving bf16 natively.
    g = jax.shard_map(swap_x, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
    c = jax.jit(g).lower(jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)).compile()
    (p,) = only(hs.collectives(c), "collective-permute")
    assert p.operand_shapes == (hs.ArrayShape("f32", (8, 8)),)


# --------------------------------------------------------------------------------------------------
# FLOPs


def test_cost_analysis_counts_loop_body_once_and_we_do_not():
    m, k, n, t = 64, 32, 48, 7

    def loop_free(a, b):
        return a @ b

    a = jax.ShapeDtypeStruct((m, k), jnp.float32)
    c = jax.jit(loop_free).lower(a, jax.ShapeDtypeStruct((k, n), jnp.float32)).compile()
    assert hs.flops_per_device(c) == 2 * m * n * k
    assert hs.cost_analysis_flops(c) == 2 * m * n * k  # validates the dot formula against XLA

    def scanned(a, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), a, ws)[0]

    c = jax.jit(scanned).lower(a, jax.ShapeDtypeStruct((t, k, k), jnp.float32)).compile()
    one_body = 2 * m * k * k
    assert hs.flops_per_device(c) == t * one_body
    f = hs.hlo_flops(c)
    assert f.dot == t * one_body and f.count_exact
    assert f.transcendentals == t * m * k
    # jax 0.10.2: cost_analysis counts the body once (plus the loop counter's add and compare). If this
    # starts failing, XLA has begun multiplying by trip counts; flops_per_device does not depend on it.
    assert hs.cost_analysis_flops(c) < 2 * one_body


def test_flops_match_cost_analysis_loop_free():
    def mlp(x, w1, w2):
        return jnp.einsum("bsf,fd->bsd", jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, w1)), w2)

    shapes = [(2, 16, 32), (32, 64), (64, 32)]
    c = jax.jit(mlp).lower(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).compile()
    f = hs.hlo_flops(c)
    assert f.dot == 2 * (2 * 16 * 32 * 64) * 2
    assert f.total == hs.cost_analysis_flops(c)
    assert f.transcendentals == c.cost_analysis().get("transcendentals")

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
        )

    c = jax.jit(conv).lower(jnp.zeros((2, 10, 10, 4)), jnp.zeros((3, 3, 2, 6))).compile()
    assert hs.hlo_flops(c).convolution == 2 * (2 * 8 * 8 * 6) * (3 * 3 * 2) == hs.cost_analysis_flops(c)


def test_sharded_scanned_matmul_per_device(mesh):
    t = 3

    def f(v, w):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), v, w)[0]

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("x", "y"), P()), out_specs=P("x", "y"))
    c = jax.jit(g).lower(jnp.zeros((16, 32)), jnp.zeros((t, 8, 8))).compile()
    assert hs.flops_per_device(c) == t * 2 * 8 * 8 * 8  # the local block, not the global array


def test_memory_per_device(mesh):
    c = compile_sharded(mesh, lambda v: jax.lax.psum(v, "y"))
    mem = hs.memory_per_device(c)
    assert mem["argument"] == LOCAL and mem["output"] == LOCAL
    for key in ("alias", "temp", "generated_code", "peak", "total"):
        assert key in mem and mem[key] >= 0
    assert (
        mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    )


# --------------------------------------------------------------------------------------------------
# Forms the CPU backend does not emit, written by hand in XLA's text syntax.

ASYNC_HLO = """\
HloModule handwritten, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_a2a (p: bf16[4,16]) -> bf16[4,16] {
  %p = bf16[4,16]{1,0} parameter(0)
  ROOT %a2a = bf16[4,16]{1,0} all-to-all(%p), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}
}

%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %cps = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=3, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[8,8]{1,0} collective-permute-done(%cps)
  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%i, %cpd)
}

%cond (t.1: (s32[], f32[8,8])) -> pred[] {
  %t.1 = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x.1: f32[8,8], y.1: bf16[4,16]) -> f32[8,8] {
  %x.1 = f32[8,8]{1,0} parameter(0)
  %y.1 = bf16[4,16]{1,0} parameter(1)
  %ars = f32[8,8]{1,0} all-reduce-start(%x.1), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), \
use_global_device_ids=true, to_apply=%add
  %ard = f32[8,8]{1,0} all-reduce-done(%ars)
  %ags = (f32[8,8]{1,0}, f32[64,8]{1,0}) all-gather-start(%ard), channel_id=2, replica_groups={}, \
dimensions={0}, use_global_device_ids=true
  %agd = f32[64,8]{1,0} all-gather-done(%ags)
  %as = ((bf16[4,16]{1,0}), bf16[4,16]{1,0}, u32[]) async-start(%y.1), calls=%wrapped_a2a
  %ad = bf16[4,16]{1,0} async-done(%as), calls=%wrapped_a2a
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %ard)
  %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,8]{1,0} get-tuple-element(%w), index=1
}
""".replace("\\\n", "")


def test_async_and_iota_forms_from_text():
    cs = {c.kind: c for c in hs.collectives(ASYNC_HLO)}
    assert set(cs) == {"all-reduce", "all-gather", "all-to-all", "collective-permute"}

    ar = cs["all-reduce"]
    assert ar.opcode == "all-reduce-start" and ar.count == 1
    assert ar.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and ar.group_size == 2
    assert ar.bytes_per_device == LOCAL and ar.bytes_sent_per_device == LOCAL  # 2 * (2-1)/2

    ag = cs["all-gather"]
    assert ag.group_size == 8  # replica_groups={} is every device
    assert ag.result_shapes == (hs.ArrayShape("f32", (64, 8)),)  # from the -done
    assert ag.bytes_sent_per_device == 7 * LOCAL

    a2a = cs["all-to-all"]
    assert a2a.computation == "wrapped_a2a" and a2a.count == 1  # async-done is not walked again
    assert a2a.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert a2a.bytes_per_device == 4 * 16 * 2 and a2a.bytes_sent_per_device == 4 * 16 * 2 * 3 / 4

    cp = cs["collective-permute"]
    assert cp.opcode == "collective-permute-start" and cp.group_size == 4
    assert cp.result_shapes == (hs.ArrayShape("f32", (8, 8)),)
    assert cp.count == 1 and not cp.count_exact  # the while has no known_trip_count

    s = hs.summarize(ASYNC_HLO)
    assert s["total"]["instructions"] == 4 and s["total"]["count"] == 4


def test_array_shape_bytes():
    assert hs.ArrayShape("bf16", (3, 5)).nbytes == 30
    assert hs.ArrayShape("s4", (3,)).nbytes == 2
    assert hs.ArrayShape("pred", ()).nbytes == 1
    assert str(hs.ArrayShape("f32", (2, 3))) == "f32[2,3]"
