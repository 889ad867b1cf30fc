"""XLA:CPU computes 16-bit elementwise ops in float32 (``Backend.low_elementwise``):
amp keeps the ``follow`` ops between two low matmuls out of the compute dtype
there, with the reason in ``explain``; the matmuls still run low, each operand
cast once. The data-movement ops it computes in float32 too (a concatenate, a
gather) stay float32 and are cast once, after them. GPU plans are unchanged,
and ``backend_aware=False`` still lowers everything."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    BF16,
    F16,
    F32,
    eqns,
    hand_bf16_matmul,
    low_elementwise,
    ode_loss,
    prim_dtypes,
    rel,
)

import amp_jax
from amp_jax import Policy, amp
from amp_jax._src import backends
from benchmarks.compile_time import distinct_kernels as _kernels

REASON = "XLA:CPU computes {} elementwise ops in float32 (a convert each way)"


def _two_layers(w1, w2, x):
    return jnp.tanh(x @ w1 + 1.0) @ w2


def _loss(w1, w2, x):
    return jnp.sum(_two_layers(w1, w2, x) ** 2)


def _args():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    n = jax.random.normal
    return n(k[0], (128, 128)) / 11, n(k[1], (128, 128)) / 11, n(k[2], (64, 128))


def _low(dtype):
    return {"bfloat16": BF16, "float16": F16}[dtype]


@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
def test_cpu_keeps_a_follow_op_between_two_matmuls_out_of_the_compute_dtype(policy):
    assert not backends.backend_for("cpu").low_elementwise
    jaxpr = jax.make_jaxpr(jax.value_and_grad(amp(_loss, policy=policy)))(*_args())
    # the matmuls run low, forward and backward
    dots = prim_dtypes(jaxpr, "dot_general")
    assert dots and all(ins == (_low(policy),) * 2 for ins, _, _ in dots), dots
    # the tanh, the add before it and their derivatives run as written: float32
    for name in ("tanh", "add", "mul", "sub"):
        for ins, outs, _ in prim_dtypes(jaxpr, name):
            assert set(ins) | set(outs) <= {F32}, (name, ins, outs)
    # and explain gives the reason on their rows
    ex = amp_jax.explain(_two_layers, *_args(), policy=policy)
    tanh = [r for r in ex.rows if r.primitive == "tanh"]
    assert tanh and all(REASON.format(policy) in r.reason for r in tanh), tanh


def test_the_gpu_record_and_backend_unaware_policies_paint_it_low():
    with backends.use(backends.backend_for("gpu")):
        gpu = jax.make_jaxpr(amp(_two_layers))(*_args())
    assert [ins for ins, _, _ in prim_dtypes(gpu, "tanh")] == [(BF16,)]
    unaware = jax.make_jaxpr(amp(_two_layers, policy=Policy("bfloat16", backend_aware=False)))(
        *_args()
    )
    assert [ins for ins, _, _ in prim_dtypes(unaware, "tanh")] == [(BF16,)]
    ex = amp_jax.explain(_two_layers, *_args(), policy=Policy("bfloat16", backend_aware=False))
    (tanh,) = [r for r in ex.rows if r.primitive == "tanh"]
    assert "XLA:CPU" not in tanh.reason and "between two bfloat16 ops" in tanh.reason


def test_each_low_dot_operand_is_cast_once():
    jaxpr = jax.make_jaxpr(amp(_two_layers))(*_args())
    to_low = [e for e, _ in eqns(jaxpr) if e.primitive.name == "convert_element_type"]
    to_low = [e for e in to_low if np.dtype(e.params["new_dtype"]) == BF16]
    # two dots, two operands each: four casts to bf16, one per operand
    dots = [e for e, _ in eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and len(to_low) == 4, jaxpr


def _hlo_ops(fn, args):
    text = jax.jit(jax.value_and_grad(fn)).lower(*args).compile().as_text()
    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ ([\w\-]+)\(", text, flags=re.M)
    return ops.count("convert"), ops.count("dot")


def test_optimized_hlo_has_about_one_convert_per_dot_on_cpu():
    """XLA:CPU's float normalization wraps each bf16 elementwise op in a
    convert each way: a train step whose activations run in bf16 had 117
    converts for 8 dots (workloads.models.mlp); keeping them float32, at most
    one per dot operand is left (9)."""
    from workloads import models

    m = models.mlp(small=True)
    args = (m.init(jax.random.PRNGKey(0)), *m.batch(jax.random.PRNGKey(1)))
    converts, dots = _hlo_ops(amp(m.loss), args)
    assert dots and converts <= 2 * dots, (converts, dots)
    with low_elementwise():  # (what a GPU's painting does, on XLA:CPU)
        low_converts, _ = _hlo_ops(amp(m.loss), args)
    assert low_converts > 4 * converts, (low_converts, converts)


def test_the_backend_field_is_part_of_the_trace_key():
    f = amp(_two_layers)  # (one amp function; a fresh caller each time: JAX's own trace
    # cache does not know the injected record)
    cpu = jax.make_jaxpr(lambda *a: f(*a))(*_args())
    record = dataclasses.replace(backends.current(), low_elementwise=True)
    with backends.use(record):
        low = jax.make_jaxpr(lambda *a: f(*a))(*_args())
    assert [i for i, _, _ in prim_dtypes(cpu, "tanh")] == [(F32,)]
    assert [i for i, _, _ in prim_dtypes(low, "tanh")] == [(BF16,)]


def _graph_layer(w1, w2, w3, x, idx):
    """A graph network's edge update: features of two layers, the input and a
    gathered row concatenated, then one dot (jax-md's ``EnergyGraphNet``)."""
    h1, h2 = jnp.tanh(x @ w1), jnp.sin(x @ w2)
    return jnp.concatenate([h1, h2, x, h1[idx]], axis=1) @ w3


def _graph_loss(w1, w2, w3, x, idx):
    return jnp.sum(_graph_layer(w1, w2, w3, x, idx) ** 2)


def _graph_args():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    n = jax.random.normal
    w1, w2 = n(k[0], (64, 64)) / 8, n(k[1], (64, 64)) / 8
    idx = jnp.arange(128)[::-1] % 128
    return w1, w2, n(k[2], (256, 64)) / 16, n(k[3], (128, 64)), idx


def _graph_step(argnums=(0, 1, 2, 3)):
    # (a fresh caller each time: JAX's trace cache does not know an injected record)
    return lambda *a: jax.value_and_grad(amp(_graph_loss), argnums=argnums)(*a)


def _without_clear_in_float32():
    return backends.use(dataclasses.replace(backends.current(), clear_in_float32=frozenset()))


def test_cpu_concatenates_in_float32_and_casts_the_result_once():
    """XLA:CPU computes a bf16 concatenate or gather in float32 (each input
    converted up and the result down): amp keeps them float32 there and the
    dot casts the concatenation once, where it cast each input (and XLA
    added a float32 round trip per input, a kernel each)."""
    args = _graph_args()
    step = _graph_step()
    jaxpr = jax.make_jaxpr(step)(*args)
    assert [(i[0], o) for i, o, _ in prim_dtypes(jaxpr, "concatenate")] == [(F32, (F32,))]
    assert [o for _, o, _ in prim_dtypes(jaxpr, "gather")] == [(F32,)]
    dots = prim_dtypes(jaxpr, "dot_general")
    assert dots and all(ins == (BF16, BF16) for ins, _, _ in dots), dots
    hlo = jax.jit(step).lower(*args).compile().as_text()
    up = re.findall(r"= f32\[[\d,]*\]\S* convert\(", hlo)  # (bf16 -> f32: round trips)
    with _without_clear_in_float32():  # (the painting before: each input cast)
        old = jax.make_jaxpr(_graph_step())(*args)
        old_hlo = jax.jit(_graph_step()).lower(*args).compile().as_text()
    assert [o for _, o, _ in prim_dtypes(old, "concatenate")] == [(BF16,)]
    assert len(up) < len(re.findall(r"= f32\[[\d,]*\]\S* convert\(", old_hlo))
    # (fewer distinct kernels on JAX 0.10's XLA; JAX 0.12's fuses this toy's round trips)
    assert len(_kernels(hlo)) <= len(_kernels(old_hlo))


def test_the_concatenation_is_split_in_float32_in_the_backward():
    """The concatenate's transpose (a ``split`` of its cotangent) runs in
    float32, not on a bf16 cotangent: the same forward values (one rounding
    of the concatenation either way), and ``x``'s gradient, which reaches the
    dot through the concatenation too, closer to float32's."""
    args = _graph_args()
    assert [o for _, o, _ in prim_dtypes(jax.make_jaxpr(_graph_step())(*args), "split")] == [
        (F32,) * 4
    ]
    f32_loss, f32_gx = jax.jit(jax.value_and_grad(_graph_loss, argnums=3))(*args)
    loss, gx = jax.jit(_graph_step(3))(*args)
    with _without_clear_in_float32():
        old_loss, old_gx = jax.jit(_graph_step(3))(*args)
    assert float(loss) == float(old_loss)
    assert rel(gx, f32_gx) < rel(old_gx, f32_gx), (rel(gx, f32_gx), rel(old_gx, f32_gx))
    assert rel(loss, f32_loss) < 2e-2


def test_gpu_plans_still_concatenate_low():
    with backends.use(backends.backend_for("gpu")):
        jaxpr = jax.make_jaxpr(amp(_graph_layer))(*_graph_args())
    assert [o for _, o, _ in prim_dtypes(jaxpr, "concatenate")] == [(BF16,)]


def _ode_loss(mm):
    pytest.importorskip("diffrax")
    return ode_loss(mm, "Dopri5")


@pytest.mark.heavy
def test_diffrax_adaptive_solve_error_within_twice_the_hand_cast_one():
    """Issue 56: with the tanh between the vector field's two matmuls in bf16,
    amp's rounding reached the step-size controller (loss error 2.6x the
    hand-cast program's); on CPU it now runs in float32, as the hand-cast
    program's does."""
    w1 = jax.random.normal(jax.random.PRNGKey(0), (32, 64)) / 6
    w2 = jax.random.normal(jax.random.PRNGKey(1), (64, 32)) / 8
    y0 = jax.random.normal(jax.random.PRNGKey(2), (16, 32))

    def run(f):
        return jax.jit(jax.value_and_grad(f, (0, 1)))(w1, w2, y0)

    want = run(_ode_loss(lambda a, b: a @ b))
    hand = run(_ode_loss(hand_bf16_matmul))
    got = run(amp(_ode_loss(lambda a, b: a @ b)))
    assert rel(got[0], want[0]) <= 2 * rel(hand[0], want[0]), (got[0], hand[0], want[0])
    for g, h, w in zip(got[1], hand[1], want[1]):
        assert rel(g, w) <= 2 * rel(h, w), (rel(g, w), rel(h, w))
