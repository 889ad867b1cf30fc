"""Structure behind amp's speed (never timings; those live in benchmarks/run.py).

Uses the benchmark models (``workloads/models.py``) at small sizes:

* backward dots are never mixed-dtype, and non-batched ones take bf16 operands
  in the layouts XLA:CPU runs fast;
* the optimized HLO of the amp train step has no more ``convert``s than the
  hand-written bf16 version of the same model;
* every parameter is cast to bf16 at most once per step.

The trace cache (one trace per input signature) is tested in
``tests/test_transform.py::test_trace_cached_per_signature``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F32, _open, allow_out_dtype, check_dots_low, eqns, rel
from jax.extend import core as jex_core

from amp_jax import amp
from amp_jax._src.backends.cpu import materialized_transpose
from workloads import models as M

SMALL = {"mlp": M.mlp(small=True), "gpt": M.gpt(small=True)}


def _args(model):
    return (model.init(jax.random.PRNGKey(0)), *model.batch(jax.random.PRNGKey(1)))


def _grad_jaxpr(fn, args):
    return jax.make_jaxpr(jax.value_and_grad(fn))(*args)


def _is_fast_cpu_layout(e) -> bool:
    """lhs contracts its trailing dims; rhs its leading or trailing dims."""
    (ca, cb), _ = e.params["dimension_numbers"]
    na, nb, k = e.invars[0].aval.ndim, e.invars[1].aval.ndim, len(ca)
    return tuple(ca) == tuple(range(na - k, na)) and tuple(cb) in (
        tuple(range(k)),
        tuple(range(nb - k, nb)),
    )


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_no_mixed_dtype_dots_in_backward(name):
    model = SMALL[name]
    jaxpr = _grad_jaxpr(amp(model.loss), _args(model))
    n_low = 0
    for e, _ in eqns(jaxpr):
        if e.primitive.name != "dot_general":
            continue
        ins = tuple(np.dtype(v.aval.dtype) for v in e.invars)
        assert ins[0] == ins[1], f"mixed-dtype dot {ins}"
        batched = bool(e.params["dimension_numbers"][1][0])
        if not batched or jax.default_backend() != "cpu":
            assert ins == (BF16, BF16), ins
            assert np.dtype(e.outvars[0].aval.dtype) == allow_out_dtype()
            n_low += 1
            if jax.default_backend() == "cpu":
                assert _is_fast_cpu_layout(e), e.params["dimension_numbers"]
    # forward + two backward dots per dense layer, but none for the gradient of
    # the MLP's input (not differentiated); the GPT: 4 dense dots in the scan
    # body, which appears once, and its tied head
    assert n_low >= {"mlp": 3 * 3 - 1, "gpt": 3 * 4 + 3}[name], n_low


_CONVERT = re.compile(r"=\s*\S+\s+convert\(")

#: allowed excess of amp's converts over the hand-written bf16 model's (none today).
CONVERT_SLACK = 0


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hlo_converts_not_more_than_hand_bf16(name):
    model = SMALL[name]
    args = _args(model)

    def hlo(fn):
        return jax.jit(jax.value_and_grad(fn)).lower(*args).compile().as_text()

    text_amp = hlo(amp(model.loss))
    n_amp = len(_CONVERT.findall(text_amp))
    n_hand = len(_CONVERT.findall(hlo(lambda *a: model.loss(*a, dtype=jnp.bfloat16))))
    assert n_amp <= n_hand + CONVERT_SLACK, (n_amp, n_hand)
    # ... and amp did rewrite the step: the compiled program converts to bf16
    # (a float32 step has no converts at all, and would pass the bound above).
    assert n_amp > 0 and "bf16[" in text_amp


def _param_bf16_casts(closed, n_params):
    """{param index: number of convert_element_type-to-bf16 of it}, through sub-jaxprs
    whose invars are the eqn's operands one-to-one (scan, jit, remat, custom_vjp)."""
    counts = {i: 0 for i in range(n_params)}

    def walk(jaxpr, origin):  # origin: var -> param index
        for e in _open(jaxpr).eqns:
            if e.primitive.name == "convert_element_type":
                v = e.invars[0]
                if (
                    not isinstance(v, jex_core.Literal)
                    and v in origin
                    and np.dtype(e.params["new_dtype"]) == BF16
                ):
                    counts[origin[v]] += 1
            for sub in jex_core.jaxprs_in_params(e.params):
                sub_open = _open(sub)
                if len(sub_open.invars) == len(e.invars):
                    sub_origin = {
                        sv: origin[v]
                        for sv, v in zip(sub_open.invars, e.invars)
                        if not isinstance(v, jex_core.Literal) and v in origin
                    }
                else:
                    sub_origin = {}
                walk(sub_open, sub_origin)

    j = _open(closed)
    walk(j, {v: i for i, v in enumerate(j.invars[:n_params])})
    return counts


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_params_cast_once_per_step(name):
    model = SMALL[name]
    args = _args(model)
    n_params = len(jax.tree.leaves(args[0]))
    counts = _param_bf16_casts(_grad_jaxpr(amp(model.loss), args), n_params)
    assert max(counts.values()) <= 1, counts
    assert sum(counts.values()) >= 3, counts  # the matmul weights are cast (once)


def test_materialized_transpose_is_a_transpose():
    x = jnp.arange(2 * 6 * 40, dtype=F32).reshape(2, 6, 40)
    for perm in [(2, 0, 1), (1, 0, 2), (2, 1, 0), (0, 1, 2)]:
        assert np.array_equal(materialized_transpose(x, perm), jnp.transpose(x, perm))
    odd = jnp.ones((3, 5))  # no dimension can be split: a plain transpose
    assert materialized_transpose(odd, (1, 0)).shape == (5, 3)


def test_weight_gradient_values_match_float32_within_bf16_tolerance():
    model = SMALL["mlp"]
    args = _args(model)
    g_amp = jax.jit(jax.grad(amp(model.loss)))(*args)
    g_ref = jax.jit(jax.grad(model.loss))(*args)
    for a, b in zip(jax.tree.leaves(g_amp), jax.tree.leaves(g_ref)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=0.1, atol=0.05 * float(jnp.max(jnp.abs(b))) + 1e-6)


_HEAD = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^(?:ROOT )?%(\S+) = (\w+)\[[^\]]*\]\S* ([\w\-]+)\(")


def _dot_operand_dtypes(hlo_text):
    """(lhs, rhs) element types of every dot of an optimized HLO module (XLA:CPU
    wraps dots in fusions: types are looked up per computation)."""
    out, types = [], {}
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head:
            types = dict(re.findall(r"([\w.\-]+): (\w+)\[", head.group(2)))
            continue
        m = _INSTR.match(line.strip())
        if m:
            types[m.group(1)] = m.group(2)
            ops = re.search(r" dot\(%(\S+), %(\S+)\)", line)
            if m.group(3) == "dot" and ops:
                out.append((types.get(ops.group(1)), types.get(ops.group(2))))
    return out


_COPY = re.compile(r"= f32\[[\d,]+\]\{[\d,]+\} (?:transpose|copy)\(")
_LOW_COPY = re.compile(r"= bf16\[[\d,]+\]\{[\d,]+\} copy\(")

_LAYOUTS = {
    "x @ W (in, out)": lambda w, x: x @ w,
    "x @ W.T (out, in)": lambda w, x: x @ w.T,
    "vmap(W @ v)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "einsum oi,bi->bo": lambda w, x: jnp.einsum("oi,bi->bo", w, x),
    "einsum io,bi->bo": lambda w, x: jnp.einsum("io,bi->bo", w, x),
}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot handling")
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_every_weight_layout_keeps_its_dots_bf16_after_xla(layout):
    """Issue 28: the dots amp lowers stay bf16 in the optimized HLO whatever the
    weight layout (XLA:CPU runs a bf16 dot whose operand is a folded transpose,
    ``x @ W.T``, in float32), and an (out, in) weight's gradient is computed in
    its own layout (it was computed (in, out) and transposed in float32)."""
    apply = _LAYOUTS[layout]
    ws = [jax.random.normal(jax.random.key(i), (256, 256)) / 16 for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (64, 256))

    def loss(ws, x):
        for w in ws:
            x = jax.nn.relu(apply(w, x))
        return jnp.mean(x**2)

    hlo = jax.jit(jax.value_and_grad(amp(loss))).lower(ws, x).compile().as_text()
    dots = _dot_operand_dtypes(hlo)
    assert len(dots) >= 8, dots  # 3 forward, 3 weight gradients, 2 input gradients
    assert all(d == ("bf16", "bf16") for d in dots), dots
    # ... and no float32 transpose of a weight gradient (an (out, in) weight's
    # gradient came out (in, out) and was transposed: 6 f32 copies here)
    assert not _COPY.findall(hlo), _COPY.findall(hlo)
    # ... and the only bf16 copies are the weight gradients' transposed
    # operands, one each: no copy of a weight or an activation guards a dot
    # against XLA:CPU's transpose folding (barriers do; the permuted copies
    # of both operands they replaced were 13 copies here)
    assert len(_LOW_COPY.findall(hlo)) <= len(ws), _LOW_COPY.findall(hlo)
    ref = jax.jit(jax.grad(loss))(ws, x)
    got = jax.jit(jax.grad(amp(loss)))(ws, x)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 8e-2  # 3 bf16 layers


_TRANSPOSED_RESULTS = {
    # (apply(w, x), x's shape): the dot JAX writes, then a transpose of its result
    "vmap(W @ v)": (lambda w, x: jax.vmap(lambda v: w @ v)(x), (64, 256)),
    "vmap(vmap(W @ v))": (lambda w, x: jax.vmap(jax.vmap(lambda v: w @ v))(x), (4, 16, 256)),
}


def _transposed_low_dot_results(closed) -> list[str]:
    """The ``transpose`` eqns (at any depth) that read the result of a dot with
    bf16 operands, directly or through a ``convert_element_type``."""
    producer = {v: e for e, _ in eqns(closed) for v in e.outvars}

    def low_dot(v):
        e = producer.get(v)
        if e is not None and e.primitive.name == "convert_element_type":
            e = producer.get(e.invars[0])
        return (
            e is not None
            and e.primitive.name == "dot_general"
            and all(x.aval.dtype == BF16 for x in e.invars)
        )

    return [
        str(e)
        for e, _ in eqns(closed)
        if e.primitive.name == "transpose" and not isinstance(e.invars[0], jex_core.Literal)
        if low_dot(e.invars[0])
    ]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot layouts")
@pytest.mark.parametrize("layout", sorted(_TRANSPOSED_RESULTS))
def test_a_transposed_dot_result_is_the_dot_with_its_operands_swapped(layout):
    """A lowered dot whose result only a ``transpose`` reads (JAX's batching of
    a per-example matvec ``vmap(lambda v: W @ v)``: Equinox's ``Linear``; an
    ``einsum`` whose output puts the rhs's dims first) is the same dot with its
    operands swapped: no transpose of a bf16 dot's result is left, forward or
    backward. Left in, every elementwise op after the dot, and its backward,
    read a transposed array (``eqx.nn.MLP`` with gelu: 0.87x float32 before,
    0.65x after; benchmarks/results/RESULTS.md). Values and gradients match float32."""
    apply, x_shape = _TRANSPOSED_RESULTS[layout]
    ws = [jax.random.normal(jax.random.key(i), (256, 256)) / 16 for i in range(3)]
    x = jax.random.normal(jax.random.key(9), x_shape)

    def loss(ws, x):
        for w in ws:
            x = jax.nn.gelu(apply(w, x))
        return jnp.mean(x**2)

    closed = jax.make_jaxpr(jax.value_and_grad(amp(loss)))(ws, x)
    check_dots_low(closed, min_low=8)
    assert not _transposed_low_dot_results(closed), _transposed_low_dot_results(closed)
    ref = jax.jit(jax.value_and_grad(loss))(ws, x)
    got = jax.jit(jax.value_and_grad(amp(loss)))(ws, x)
    assert rel(got[0], ref[0]) < 2e-2
    for g, r in zip(got[1], ref[1]):
        assert g.dtype == r.dtype
        assert rel(g, r) < 8e-2  # 3 bf16 layers


_PROJECTIONS = {
    # (einsum, x's shape, w's shape): attention projections with (d, heads,
    # head_dim) and (heads, head_dim, d) weights, as in Flax's MultiHeadAttention
    "bsd,dhk->bshk": ((4, 32, 64), (64, 4, 16)),
    "bshk,hkd->bsd": ((4, 32, 4, 16), (4, 16, 64)),
}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot canonicalization")
@pytest.mark.parametrize("spec", sorted(_PROJECTIONS))
def test_a_dot_contracting_several_dims_copies_no_weight(spec):
    """XLA canonicalizes a dot contracting several dims by putting the rhs's
    contraction first: the input gradient of ``x @ W`` with a 3-D weight
    contracted over its two trailing dims copied a transposed weight in every
    step. amp merges contiguous contracting dims into one (a bitcast), so the
    only bf16 copy left is the weight gradient's transposed input. Values and
    gradients match float32."""
    xs, ws = _PROJECTIONS[spec]
    x = jax.random.normal(jax.random.key(0), xs)
    w = jax.random.normal(jax.random.key(1), ws) / 8

    def loss(w, x):
        return jnp.sum(jnp.tanh(jnp.einsum(spec, x, w)) ** 2)

    hlo = jax.jit(jax.grad(amp(loss), (0, 1))).lower(w, x).compile().as_text()
    assert len(_LOW_COPY.findall(hlo)) <= 1, _LOW_COPY.findall(hlo)
    assert all(d == ("bf16", "bf16") for d in _dot_operand_dtypes(hlo))
    got = jax.jit(jax.grad(amp(loss), (0, 1)))(w, x)
    ref = jax.jit(jax.grad(loss, (0, 1)))(w, x)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 3e-2
