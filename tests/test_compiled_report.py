"""``compiled_report``: the element types XLA compiled, after SPMD partitioning and in
the final program, against amp's plan (issue 58 item 3).

On CPU: the workloads' models agree with the plan except rows labelled with XLA's
reason; the 8-device FSDP step gathers bf16 weights after partitioning (what a GPU
moves) and XLA:CPU upcasts them to f32 afterwards (checked against XLA's own dump
after its ``spmd-partitioning`` pass); strict mode fails a float8 matmul XLA:CPU
cannot run and a bf16-output dot it upcasts.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import amp_jax
from amp_jax import Policy
from amp_jax._src import backends
from amp_jax._src.diagnostics.hlo import hlo_ops
from workloads import sharded as sm

CPU = jax.default_backend() == "cpu"


def _rand(shape, seed, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


W, X = _rand((256, 256), 0, 0.05), _rand((64, 256), 1)


def _layer(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


# -- the HLO reader ------------------------------------------------------------------------

_MODULE = """HloModule m

FileNames
1 "/src/train.py"

FunctionNames
1 "loss"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=4 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%fused (param_0: bf16[8,16], param_1: bf16[16,8]) -> f32[8,8] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[16,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp())/dot_general" stack_frame_id=1}
}

ENTRY %main (a: f8e4m3fn[8,16], b: f8e5m2[16,8], c: bf16[4]) -> f32[8,8] {
  %a = f8e4m3fn[8,16]{1,0} parameter(0)
  %b = f8e5m2[16,8]{1,0} parameter(1)
  %c = bf16[4]{0} parameter(2)
  %g = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(f)/jvp()/dot_general" source_file="/src/train.py" source_line=7}
  %ag = bf16[32]{0} all-gather(%c), dimensions={0}, metadata={op_name="jit(f)/jvp()/mul"}
  %ar = (f32[8]{0}, bf16[4]{0}) all-reduce(f32[8]{0} %x, bf16[4]{0} %c), to_apply=%add
  %att = (bf16[2,4,8]{2,1,0}, u8[0]{0}) custom-call(%c, %c, %c), custom_call_target="__cudnn$fmhaSoftmax"
}
"""


def test_hlo_reader_finds_the_ops_their_types_and_lines():
    ops = {o.name: o for o in hlo_ops(_MODULE)}
    assert set(ops) == {"d", "g", "ag", "ar", "att"}
    d = ops["d"]  # a dot in a fusion: the types of the fusion's parameters
    assert (d.kind, d.opcode, d.operands, d.result, d.shape) == (
        "matmul",
        "dot",
        ("bf16", "bf16"),
        "f32",
        "f32[8,8]",
    )
    assert d.where == "/src/train.py:12 (loss)" and d.backward
    g = ops["g"]  # cuBLASLt's fp8 GEMM
    assert (g.kind, g.opcode, g.operands) == (
        "matmul",
        "__cublas$lt$matmul$f8",
        ("f8e4m3fn", "f8e5m2"),
    )
    assert g.where == "/src/train.py:7" and not g.backward
    assert (ops["ag"].kind, ops["ag"].result, ops["ag"].nbytes) == ("collective", "bf16", 64)
    ar = ops["ar"]  # a combined all-reduce (older text types each operand)
    assert ar.operands == ("f32", "bf16") and ar.shape == "f32[8], bf16[4]" and ar.nbytes == 40
    assert ops["att"].kind == "attention"


def _operand_set(types: str) -> set[str]:
    """``{"bf16,bf16"}`` of a row's ``"bf16,bf16->f32 x3 | ..."``."""
    return {t.split("->")[0] for t in types.split(" | ")}


# -- agreement on the workloads' models -----------------------------------------------------

#: the disagreements XLA may have on CPU, each with its reason
_LABELS = ("upcast by XLA:cpu", "merged or removed by XLA", "removed or rewritten by XLA")


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_workloads_models_agree_with_the_plan_except_labelled_rows(name):
    from workloads import models

    m = getattr(models, name)(small=True)
    key = jax.random.PRNGKey(0)
    rep = amp_jax.compiled_report(m.loss, m.init(key), *m.batch(key), policy="bfloat16", grad=True)
    planned = [r for r in rep.rows if r.planned != "-"]
    # every matmul amp planned in bf16 is found, forward and backward
    low = [r for r in planned if r.kind == "matmul" and r.planned == "bf16,bf16"]
    assert {r.backward for r in low} == {False, True}, rep
    for r in rep.rows:
        if r.agrees:
            assert not r.reason
            if r.planned != "-":  # the final program runs the planned operand types
                assert _operand_set(r.final) == set(r.planned.split(" | ")), r
        else:
            assert r.reason.startswith(_LABELS), r
    if CPU and name == "mlp":
        assert all(r.agrees for r in rep.rows), rep


# -- FSDP: what a GPU moves ---------------------------------------------------------------


def _spmd_dump(lowered, tmp_path) -> str:
    """XLA's own dump of the module after its SPMD partitioner (a test's check only)."""
    opts = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "spmd-partitioning"}
    lowered.compile(compiler_options=opts)
    (name,) = [f for f in os.listdir(tmp_path) if "after_spmd-partitioning" in f]
    return (tmp_path / name).read_text()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (CPU CI forces 8)")
def test_fsdp_step_gathers_bf16_weights_after_partitioning(tmp_path):
    m = sm.mesh("fsdp", AxisType.Auto)
    with jax.set_mesh(m):
        p = sm.place(sm.init(jax.random.key(0)), "fsdp", m)
        b = sm.batch(jax.random.key(1), 16, m)
        loss = functools.partial(sm.loss, layout="fsdp")
        rep = amp_jax.compiled_report(loss, p, b, policy="bfloat16", grad=True)
        lowered = jax.jit(jax.grad(amp_jax.amp(loss, policy="bfloat16"))).lower(p, b)
    gathers = [r for r in rep.rows if r.op == "all-gather"]
    weights = [r for r in gathers if r.partitioned == "bf16"]
    # the six matmul weights are gathered in bf16 after partitioning: amp casts before
    assert sum(r.count for r in weights) == 6, rep
    nbytes = 2 * sum(v.size for k, v in p.items() if k.startswith("w"))
    assert rep.collectives("partitioned")["all-gather", "bf16"] == [6, nbytes]
    if CPU:  # XLA:CPU's float normalization gathers f32 instead: a row of its own each
        assert all(r.final == "f32" and not r.agrees for r in weights), rep
        assert all("upcast by XLA:cpu after partitioning" in r.reason for r in weights)
        assert ("all-gather", "bf16") not in rep.collectives("final")
    # the partitioned program's gathers are those of XLA's dump after partitioning
    dumped = collections.Counter(
        (o.opcode, o.result, o.shape)
        for o in hlo_ops(_spmd_dump(lowered, tmp_path))
        if o.opcode == "all-gather"
    )
    ours = collections.Counter(
        (o.opcode, o.result, o.shape)
        for o in hlo_ops(rep.partitioned_text)
        if o.opcode == "all-gather"
    )
    assert ours == dumped and ("all-gather", "bf16", "bf16[64,128]") in dumped, (ours, dumped)
    if CPU:  # strict on the collectives fails there
        with jax.set_mesh(m), pytest.raises(amp_jax.PrecisionMismatchError, match="all-gather"):
            amp_jax.compiled_report(
                loss, p, b, policy="bfloat16", grad=True, strict=lambda r: r.kind == "collective"
            )


# -- strict mode ------------------------------------------------------------------------------


def _with_native_fp8() -> backends.Backend:
    return dataclasses.replace(backends.current(), native_float8_matmul=lambda: True)


@pytest.mark.skipif(not CPU, reason="XLA:CPU has no float8 dot: the fallback is this backend's")
def test_strict_fails_a_float8_matmul_that_falls_back():
    # amp plans float8 GEMMs (as on an H100); XLA:CPU cannot run an fp8 dot and upcasts it
    with backends.use(_with_native_fp8()):
        rep = amp_jax.compiled_report(_layer, W, X, policy="float8", grad=True)
        with pytest.raises(amp_jax.PrecisionMismatchError, match="cannot compile float8_e"):
            amp_jax.compiled_report(_layer, W, X, policy="float8", grad=True, strict=True)
    fp8 = [r for r in rep.rows if r.kind == "matmul"]
    assert {r.planned for r in fp8} == {"f8e4m3fn,f8e4m3fn", "f8e4m3fn,f8e5m2"}, rep
    assert all(not r.agrees and r.final == "f32,f32->f32" for r in fp8), rep
    assert "operand_upcaster" in rep.kept_passes
    # emulated on CPU (the default record): bf16 dots as planned, forward at least
    fwd = lambda r: not r.backward  # noqa: E731
    rep = amp_jax.compiled_report(_layer, W, X, policy="float8", grad=True, strict=fwd)
    assert {r.planned for r in rep.rows} == {"bf16,bf16"}, rep
    assert all(r.agrees or r.reason.startswith(_LABELS) for r in rep.rows), rep


@pytest.mark.skipif(not CPU, reason="XLA:CPU has no bf16-result dot")
def test_strict_fails_a_bf16_output_dot_xla_cpu_cannot_compile():
    policy = Policy(allow_outputs="compute")  # bf16 results, as on a GPU
    rep = amp_jax.compiled_report(_layer, W, X, policy=policy)
    (row,) = rep.rows
    if row.final == "bf16,bf16->bf16":  # (newer XLA:CPU, JAX 0.12, runs it as planned)
        assert row.agrees and not rep.kept_passes, rep
        return
    # XLA:CPU 0.10 has no bf16-result dot: its float normalization stays on, the dot runs f32
    assert (row.planned, row.final) == ("bf16,bf16", "f32,f32->f32"), rep
    assert not row.agrees and row.reason.startswith("XLA:cpu cannot compile bfloat16"), row
    assert "float-normalization-bf16" in rep.kept_passes
    with pytest.raises(amp_jax.PrecisionMismatchError, match="planned bf16,bf16, ran f32"):
        amp_jax.compiled_report(_layer, W, X, policy=policy, strict=True)
    # a predicate that selects no disagreeing row passes
    amp_jax.compiled_report(_layer, W, X, policy=policy, strict=lambda r: r.kind == "collective")


def test_strict_must_be_a_bool_or_a_predicate():
    with pytest.raises(TypeError, match="strict must be a bool or a predicate"):
        amp_jax.compiled_report(_layer, W, X, strict="yes")


def test_a_function_without_a_plan_reports_what_ran():
    def hand_cast(w, x):
        bf = jnp.bfloat16
        return jnp.sum(jnp.dot(x.astype(bf), w.astype(bf), preferred_element_type=jnp.float32))

    rep = amp_jax.compiled_report(hand_cast, W, X)
    (row,) = rep.rows
    assert row.planned == "-" and row.agrees and row.final == "bf16,bf16->f32", row
