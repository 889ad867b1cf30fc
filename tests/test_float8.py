"""Float8 matmuls (``Policy(float8=...)``): structure, scales, numerics, policy.

On CPU the fp8 products are emulated (fp8 round trip + bf16 dot); on a GPU
with fp8 matmuls (compute capability >= 8.9) they are dots of the fp8
operands themselves, their scales applied to the result. Both forms are
checked on CPU (a `Backend` record injected with ``backends.use``); the GPU-only test checks that XLA turned
them into fp8 GEMMs (cuBLASLt or a Triton GEMM fusion).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F32, eqns, rel

import amp_jax
from amp_jax import Policy, amp, get_policy
from amp_jax._src import backends, decision
from amp_jax._src.backends import backend_for
from amp_jax._src.rules.dots import float8

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def _casts_to(jaxpr):
    """Counts of the dtypes ``convert_element_type`` eqns write, recursively."""
    out: dict = {}
    for e, _ in eqns(jaxpr):
        if e.primitive.name == "convert_element_type":
            d = np.dtype(e.outvars[0].aval.dtype)
            out[d] = out.get(d, 0) + 1
    return out


def _dots(jaxpr):
    return [
        tuple(np.dtype(v.aval.dtype) for v in e.invars)
        for e, _ in eqns(jaxpr)
        if e.primitive.name == "dot_general"
    ]


def _layer(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _rand(shape, seed, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


W, X = _rand((256, 256), 0, 0.05), _rand((64, 256), 1)


# -- structure ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["float8", "float8_rowwise"])
def test_forward_e4m3_backward_e5m2_in_the_jaxpr(policy):
    fwd = jax.make_jaxpr(amp(_layer, policy=policy))(W, X)
    casts = _casts_to(fwd)
    assert casts.get(E4M3) == 2 and E5M2 not in casts  # x and w quantized, forward only
    # emulated: a dot of the dequantized fp8 values; native: of the fp8 values
    operands = (E4M3, E4M3) if NATIVE else (BF16, BF16)
    assert _dots(fwd) == [operands]
    reduce_max = [e for e, _ in eqns(fwd) if e.primitive.name == "reduce_max"]
    assert len(reduce_max) == 2  # one amax per operand: the dynamic scales
    grad = jax.make_jaxpr(jax.grad(amp(_layer, policy=policy)))(W, X)
    casts = _casts_to(grad)
    assert casts.get(E5M2, 0) >= 1 and casts.get(E4M3, 0) >= 2
    # forward + the two cotangent products
    if NATIVE:  # the cotangent products take the e5m2 cotangent and an e4m3 operand
        kinds = sorted(tuple(sorted(map(str, d))) for d in _dots(grad))
        want = [("float8_e4m3fn", "float8_e4m3fn")] + [("float8_e4m3fn", "float8_e5m2")] * 2
        assert kinds == want, _dots(grad)
    else:
        assert _dots(grad) == [(BF16, BF16)] * 3


def test_rowwise_scales_reduce_over_the_contraction():
    jaxpr = jax.make_jaxpr(jax.grad(amp(_layer, policy="float8_rowwise")))(W, X)
    axes = sorted(
        (tuple(e.params["axes"]), tuple(e.invars[0].aval.shape))
        for e, _ in eqns(jaxpr)
        if e.primitive.name == "reduce_max"
    )
    # forward: x [64,256] over K (dim 1), w [256,256] over K (dim 0); backward: the
    # cotangent [64,256] over N for dx and over M for dw; w over N, x over M.
    assert axes == sorted(
        [((1,), (64, 256)), ((0,), (256, 256)), ((1,), (64, 256)), ((1,), (256, 256))]
        + [((0,), (64, 256)), ((0,), (64, 256))]
    )


def test_small_batched_and_conv_matmuls_keep_the_bf16_rule():
    def f(a, b, q, k):
        small = a @ b  # 2 * 8 * 64 * 64 FLOPs: below float8_min_flops
        att = jnp.einsum("bqd,bkd->bqk", q, k)  # batched: attention stays bf16
        return jnp.sum(small) + jnp.sum(att)

    args = (_rand((8, 64), 0), _rand((64, 64), 1), _rand((2, 64, 64), 2), _rand((2, 64, 64), 3))
    jaxpr = jax.make_jaxpr(jax.grad(amp(f, policy="float8")))(*args)
    casts = _casts_to(jaxpr)
    assert E4M3 not in casts and E5M2 not in casts
    assert all(d == (BF16, BF16) or d == (F32, F32) for d in _dots(jaxpr))
    # the threshold is a policy field: lowering it turns the small one to fp8
    p = Policy(float8="tensorwise", float8_min_flops=0)
    assert _casts_to(jax.make_jaxpr(amp(f, policy=p))(*args)).get(E4M3) == 2


def test_explain_says_why_a_dot_is_not_float8():
    def f(a, b, q, k):
        return jnp.sum(a @ b) + jnp.sum(jnp.einsum("bqd,bkd->bqk", q, k))

    args = (_rand((8, 64), 0), _rand((64, 64), 1), _rand((2, 64, 64), 2), _rand((2, 64, 64), 3))
    ex = amp_jax.explain(f, *args, policy="float8")
    reasons = sorted(r.reason for r in ex.rows if r.primitive == "dot_general")
    assert len(reasons) == 2, reasons
    (small,) = [r for r in reasons if "float8_min_flops" in r]
    (batched,) = [r for r in reasons if r != small]
    assert "not float8" in small
    if jax.default_backend() == "cpu":  # no bf16 kernel for batched dots there
        assert "runs in float32" in batched, batched
    else:
        assert "not float8" in batched and "batched dot" in batched, batched


def test_short_contraction_stays_bf16():
    f = amp(lambda a, b: a @ b, policy=Policy(float8="tensorwise", float8_min_flops=0))
    jaxpr = jax.make_jaxpr(f)(_rand((512, 8), 0), _rand((8, 512), 1))
    assert E4M3 not in _casts_to(jaxpr) and _dots(jaxpr) == [(BF16, BF16)]


# -- scales and extreme values --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scales_are_finite_powers_of_two_for_extreme_tensors(dtype):
    fmax = float(jnp.finfo(dtype).max)
    cases = {
        "zeros": jnp.zeros((4, 8)),
        "tiny": jnp.full((4, 8), 1e-38),
        "huge": jnp.full((4, 8), 3e38),
        "inf": jnp.zeros((4, 8)).at[1, 2].set(jnp.inf),
        "nan": jnp.zeros((4, 8)).at[0, 0].set(jnp.nan),
        "normal": _rand((4, 8), 5, 1000.0),
    }
    scale_of = jax.jit(float8.scale_of, static_argnums=(1, 2))
    for name, x in cases.items():
        for axes in (None, (1,)):
            s = np.asarray(scale_of(x, dtype, axes))
            assert np.all(np.isfinite(s)) and np.all(s > 0), (name, axes, s)
            m, _ = np.frexp(s)
            assert np.all(m == 0.5), (name, s)  # powers of two: dequantization is exact
            q = np.asarray(float8.quantize(x, dtype, s).astype(jnp.float32))
            finite = np.isfinite(np.asarray(x))
            assert np.all(np.abs(q[finite]) <= fmax), name  # never out of range
            assert np.all(np.isnan(q[~finite])), name  # inf/nan stay non-finite
    rt = np.asarray(float8.round_trip(cases["zeros"], dtype))
    assert np.all(rt == 0)
    x = cases["normal"]
    rel = np.abs(np.asarray(float8.round_trip(x, dtype), np.float32) - x) / np.abs(x)
    assert rel.max() <= 2.0 ** -(3 if dtype == E4M3 else 2)  # half an ulp of the fp8 mantissa


def test_extreme_inputs_through_amp_and_grad():
    f = amp(_layer, policy="float8")
    zeros = jnp.zeros_like(X)
    gw, gx = jax.grad(f, argnums=(0, 1))(W, zeros)
    assert float(f(W, zeros)) == 0.0
    assert np.all(np.isfinite(gw)) and np.all(np.isfinite(gx))
    huge = X * 1e30  # amax far beyond fp8: the scale takes it, output finite
    out = jax.jit(amp(lambda w, x: x @ w, policy="float8"))(W, huge)
    ref = np.asarray(huge, np.float64) @ np.asarray(W, np.float64)
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.1
    with_inf = X.at[3, 5].set(jnp.inf)  # an overflow stays visible (no silent saturation)
    out = jax.jit(amp(lambda w, x: x @ w, policy="float8"))(W, with_inf)
    assert not np.all(np.isfinite(out[3]))
    assert np.all(np.isfinite(np.delete(np.asarray(out), 3, axis=0)))  # other rows: fine


# -- numerics -------------------------------------------------------------------------------


def _mlp_params(width=256, depth=3):
    return [_rand((width, width), 10 + i, width**-0.5) for i in range(depth)]


def _mlp(params, x):
    for w in params:
        x = jax.nn.gelu(x @ w)
    return jnp.mean(x**2)


NATIVE = backend_for(jax.default_backend()).native_float8_matmul()


def test_emulation_computes_the_fp8_products_exactly():
    x, w = _rand((128, 256), 1), _rand((256, 128), 2, 0.05)
    f32_out = Policy(float8="tensorwise", allow_outputs="float32")
    out = np.asarray(jax.jit(amp(lambda a, b: a @ b, policy=f32_out))(x, w), np.float64)
    xq = np.asarray(float8.round_trip(x, E4M3), np.float64)
    wq = np.asarray(float8.round_trip(w, E4M3), np.float64)
    if NATIVE:  # the fp8 GEMM: same products, the tensor cores' own accumulation
        assert np.linalg.norm(out - xq @ wq) / np.linalg.norm(xq @ wq) < 5e-3
    else:  # emulated: the exact fp8 products, float32 accumulation
        np.testing.assert_allclose(out, xq @ wq, rtol=1e-5, atol=1e-5)
    # and the fp8 rounding is really there (XLA did not fold the round trip away)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    err8 = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    out16 = jax.jit(amp(lambda a, b: a @ b, policy=f32_out.replace(float8="off")))(x, w)
    err16 = np.linalg.norm(out16 - ref) / np.linalg.norm(ref)
    assert 0.01 < err8 < 0.08 and err16 < 0.01, (err8, err16)


@pytest.mark.parametrize("policy", ["float8", "float8_rowwise"])
def test_mlp_gradients_agree_within_the_fp8_floor(policy):
    params, x = _mlp_params(), _rand((64, 256), 3)
    g32 = jax.jit(jax.grad(_mlp))(params, x)
    g16 = jax.jit(jax.grad(amp(_mlp, policy="bfloat16")))(params, x)
    g8 = jax.jit(jax.grad(amp(_mlp, policy=policy)))(params, x)
    e16, e8 = rel(g16, g32), rel(g8, g32)
    # measured (CPU, JAX 0.10.2): bf16 ~0.004, fp8 ~0.04-0.06: the fp8 floor, and
    # clearly above bf16 (a test that fp8 really ran)
    assert e16 < 0.02 and 3 * e16 < e8 < 0.12, (e16, e8)
    assert all(np.dtype(g.dtype) == F32 for g in jax.tree.leaves(g8))


def test_under_jit_grad_vmap_and_scan():
    params = _mlp_params(depth=2)
    stacked = jnp.stack(params)
    x = _rand((2, 32, 256), 4)

    def scanned(ws, x):
        def body(h, w):
            return jax.nn.gelu(h @ w), None

        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h**2)

    f = amp(scanned, policy="float8")
    jaxpr = jax.make_jaxpr(jax.grad(f))(stacked, x[0])
    assert E4M3 in _casts_to(jaxpr) and E5M2 in _casts_to(jaxpr)
    g8 = jax.jit(jax.grad(f))(stacked, x[0])
    g32 = jax.grad(scanned)(stacked, x[0])
    assert rel(g8, g32) < 0.12
    per_example = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(stacked, x)
    ref = jax.vmap(jax.grad(scanned), in_axes=(None, 0))(stacked, x)
    assert per_example.shape == (2, 2, 256, 256) and rel(per_example, ref) < 0.12


# -- policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, recipe",
    [("float8", "tensorwise"), ("fp8", "tensorwise"), ("F8", "tensorwise")]
    + [("float8_rowwise", "rowwise"), ("fp8_rowwise", "rowwise")],
)
def test_presets(name, recipe):
    p = get_policy(name)
    assert p.float8 == recipe and p.compute_dtype == BF16
    assert p.replace(float8="off") == get_policy("bfloat16")  # everything else as bf16


def test_policy_validation_names_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"float8='fp8'.*'off', 'tensorwise', 'rowwise'"):
        Policy(float8="fp8")
    with pytest.raises(ValueError, match=r"float8='tensorwise'.*compute_dtype=jnp.bfloat16"):
        Policy(jnp.float16, float8="tensorwise")
    with pytest.raises(ValueError, match=r"float8_min_flops"):
        Policy(float8="tensorwise", float8_min_flops=-1)
    with pytest.raises(ValueError, match=r"'float8'.*'float8_rowwise'"):
        get_policy("float9")


def test_off_is_the_bf16_policy():
    a = jax.make_jaxpr(amp(_layer, policy="bfloat16"))(W, X)
    b = jax.make_jaxpr(amp(_layer, policy=Policy(float8="off")))(W, X)
    assert str(a) == str(b)


# -- reports ------------------------------------------------------------------------------


def test_explain_and_dtype_report_say_float8_and_emulated():
    backend = backends.current()
    ex = amp_jax.explain(_layer, W, X, policy="float8_rowwise", grad=True)
    # forward, backward groups (JAX 0.12 leaves a dead dot under grad: its
    # row says it is unused, XLA removes it)
    dots = [r for r in ex.rows if r.primitive == "dot_general" and "unused" not in r.reason]
    assert len(dots) == 2, ex.rows
    for r in dots:
        assert decision.float8_text("rowwise", backend) in r.reason, r.reason
    assert "float8 rowwise" in ex.summary_lines()[0]
    rows = amp_jax.dtype_report(jax.grad(amp(_layer, policy="float8")), W, X)
    why = {r[5] for r in rows if r[0] == "dot_general"}
    assert why == {decision.float8_text("tensorwise", backend)}, why
    if backend.name == "cpu":
        assert "float8 tensorwise" in why.pop() and "emulated on cpu" in r.reason


def test_native_float8_matmul_off_gpu():
    assert not backend_for("cpu").native_float8_matmul()
    assert not backend_for("tpu").native_float8_matmul()


# -- GPU ---------------------------------------------------------------------------------


_F8_DOT = re.compile(r"\bdot\(f8e[45]m[23]\w*\[[^)]*f8e[45]m[23]\w*\[")


def fp8_gemms(hlo: str) -> int:
    """fp8 GEMMs in an optimized HLO module: cuBLASLt fp8 custom calls plus dots
    of two fp8 operands (XLA GPU may fuse a scaled fp8 dot into a Triton GEMM
    fusion instead of calling cuBLASLt; both run on the fp8 tensor cores)."""
    return hlo.count("__cublas$lt$matmul$f8") + len(_F8_DOT.findall(hlo))


def test_fp8_gemm_counter():
    text = (
        "%d = f32[8,8]{1,0} dot(f8e4m3fn[8,16]{1,0} %a, f8e4m3fn[16,8]{1,0} %b)\n"
        "%e = f32[8,8]{1,0} dot(f8e5m2[8,16]{1,0} %c, f8e4m3fn[16,8]{1,0} %b)\n"
        "%f = f32[8,8]{1,0} dot(bf16[8,16]{1,0} %g, bf16[16,8]{1,0} %h)\n"
        '%k = (f32[8,8]{1,0}, s8[0]) custom-call(...), custom_call_target="__cublas$lt$matmul$f8"'
    )
    assert fp8_gemms(text) == 3


CASES = {
    "x @ w": (lambda x, w: x @ w, (64, 256), (256, 128)),
    "x @ w.T": (lambda x, w: x @ w.T, (64, 256), (128, 256)),
    "3-D x": (lambda x, w: jnp.einsum("btd,df->btf", x, w), (4, 16, 256), (256, 128)),
}


def _with_native(native: bool) -> backends.Backend:
    """This process's backend record, with (or without) fp8 matmul units."""
    return dataclasses.replace(backends.current(), native_float8_matmul=lambda: native)


def test_injected_backend_is_part_of_the_trace_cache_key():
    """A trace made under an injected Backend record is not reused outside it (or
    the other way round): the record, not a module global, decides the products."""
    x, w = X, W  # (large enough for fp8)
    f = amp(lambda x, w: jnp.sum(jnp.tanh(x @ w)), policy="float8")

    def fp8_dots():  # (a new function each time: JAX's own trace cache keys on it)
        return sum(
            e.primitive.name == "dot_general" and np.dtype(e.invars[0].aval.dtype) == E4M3
            for e, _ in eqns(jax.make_jaxpr(lambda x, w: f(x, w))(x, w))
        )

    native = backends.current().native_float8_matmul()
    f(x, w)  # traced (and cached) under the process's record
    with backends.use(_with_native(not native)):
        assert fp8_dots() == (0 if native else 1)
        f(x, w)
    assert fp8_dots() == (1 if native else 0)
    assert f.trace_count == 2  # one trace per record, each reused by its own calls


@pytest.mark.parametrize("policy", ["float8", "float8_rowwise"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_fp8_products_equal_the_emulated_ones(case, policy):
    """The native form (a dot of the fp8 operands, scales applied to its result)
    computes the emulated form's products, forward and both backward ones; checked
    here with XLA running the fp8 dot on any backend."""
    f, xs, ws = CASES[case]
    x, w = _rand(xs, 5), _rand(ws, 6, 0.05)

    def loss(x, w):
        return jnp.sum(jnp.tanh(f(x, w)) ** 2)

    # the emulated form runs on CPU: XLA GPU compiles it as a bf16 GEMM of the
    # unrounded values (measured on an H100, JAX 0.11.2), so it is no reference there
    cpu = jax.devices("cpu")[0]
    x, w = jax.device_put(x, cpu), jax.device_put(w, cpu)
    out = {}
    for native in (True, False):
        vg = jax.value_and_grad(amp(loss, policy=policy), argnums=(0, 1))
        with backends.use(_with_native(native)):
            # the native form's three dots take fp8 operands; the emulated form's, bf16
            dots = [
                tuple(np.dtype(v.aval.dtype) for v in e.invars)
                for e, _ in eqns(jax.make_jaxpr(vg)(x, w))
                if e.primitive.name == "dot_general"
            ]
            fp8 = {(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)}
            assert sum(d in fp8 for d in dots) == (3 if native else 0), dots
            out[native] = jax.jit(vg)(x, w)
    g32 = jax.grad(loss, argnums=(0, 1))(x, w)
    # the same products; on CPU to float32 accumulation order, elsewhere the bf16
    # matmul outputs (Policy.allow_outputs) can round an element either way
    assert rel(out[True], out[False]) < (1e-5 if jax.default_backend() == "cpu" else 1e-3)
    assert 0.005 < rel(out[True][1], g32) < 0.12  # and both really are fp8


@pytest.mark.skipif(
    not backend_for(jax.default_backend()).native_float8_matmul(),
    reason="needs a GPU with fp8 matmuls (compute capability >= 8.9)",
)
def test_gpu_hlo_has_fp8_gemms():
    x, w = _rand((1024, 2048), 1), _rand((2048, 2048), 2, 0.02)
    loss = amp(lambda w, x: jnp.sum((x @ w) ** 2), policy="float8")
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo = step.lower(w, x).compile().as_text()
    assert fp8_gemms(hlo) >= 3, hlo[-4000:]  # forward + two backward


def test_flax_dense_and_full_precision_scope():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jax.nn.gelu(nn.Dense(256)(x))
            with jax.named_scope("head"):  # e.g. the output head, kept out of low precision
                return nn.Dense(256)(x)

    net = Net()
    params = net.init(jax.random.PRNGKey(0), X)

    def loss(p, x):
        return jnp.mean(net.apply(p, x) ** 2)

    policy = Policy(float8="tensorwise", full_precision_scopes=("head",))
    jaxpr = jax.make_jaxpr(jax.grad(amp(loss, policy=policy)))(params, X)
    casts = _casts_to(jaxpr)
    assert casts.get(E4M3, 0) >= 2 and casts.get(E5M2, 0) >= 1  # the first Dense
    assert sorted(_dots(jaxpr)).count((F32, F32)) == 3  # the scoped head: f32, fwd + bwd
    ex = amp_jax.explain(loss, params, X, policy=policy)
    reasons = {r.reason for r in ex.rows if r.primitive == "dot_general"}
    assert any("float8 tensorwise" in r for r in reasons)
    assert any("'head'" in r for r in reasons), reasons


@pytest.mark.skipif(
    not backend_for(jax.default_backend()).native_float8_matmul(),
    reason="needs a GPU with fp8 matmuls (compute capability >= 8.9)",
)
def test_gpu_rowwise_runs_fp8_gemms():
    """Per-row scales lie along kept dims: rowwise runs fp8 GEMMs too, the scales
    applied to their results (docs/float8.md)."""
    x, w = _rand((1024, 2048), 1), _rand((2048, 2048), 2, 0.02)
    loss = amp(lambda w, x: jnp.sum((x @ w) ** 2), policy="float8_rowwise")
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile().as_text()
    assert fp8_gemms(hlo) >= 3, hlo[-4000:]
