"""Never silently wrong: programs amp must get right or refuse, and the errors it gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from amp_jax import Policy, amp, dtype_report, optim
from _util import BF16, F32, prim_dtypes


# -- plain objects holding arrays ---------------------------------------------------


class Model:
    def __init__(self, w):
        self.w = w

    @amp
    def __call__(self, h):
        return h @ self.w


def test_plain_object_holding_arrays_is_refused_not_baked_in():
    m, x = Model(jnp.ones((16, 16))), jnp.ones((8, 16))
    with pytest.raises(TypeError, match=r"amp\(Model.__call__\): argument `self` is a Model that holds "
                                        r"arrays \(`self.w`\).*pytree"):
        m(x)
    # as a plain argument, nested in a container or a bound method: named too
    f = amp(lambda model, h: h @ model.w)
    with pytest.raises(TypeError, match="argument `model`"):
        f(m, x)
    class Plain:
        def __init__(self, w):
            self.w = w

        def apply(self, h):
            return h @ self.w

    g = amp(lambda fns, h: fns["apply"](h))
    with pytest.raises(TypeError, match=r"argument `fns\['apply'\]`.*`fns\['apply'\].__self__.w`"):
        g({"apply": Plain(jnp.ones((16, 16))).apply}, x)


def test_pytrees_and_static_values_still_work():
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        w: jax.Array

    p = Params(jnp.ones((16, 16)))
    f = amp(lambda p, h, act=jnp.tanh, name="x", k=2: act(h @ p.w) * k)
    np.testing.assert_allclose(f(p, jnp.ones((8, 16)), name="y"), jnp.tanh(16.0) * 2, rtol=1e-2)
    p.w = jnp.full((16, 16), 2.0)  # a pytree's arrays are inputs: no stale result
    np.testing.assert_allclose(f(p, jnp.ones((8, 16))), jnp.tanh(32.0) * 2, rtol=1e-2)


def test_signed_zero_and_nan_statics_do_not_share_a_trace():
    f = amp(lambda x, s: x / s)
    x = jnp.ones(2)
    assert float(f(x, 0.0)[0]) == np.inf
    assert float(f(x, -0.0)[0]) == -np.inf
    assert f.trace_count == 2


# -- host callbacks see the declared dtypes -------------------------------------------------


def test_callbacks_between_matmuls_see_float32():
    seen = []

    def host(a):
        seen.append(a.dtype)
        return np.asarray(a, np.float32)

    def fn(x, w):
        h = x @ w
        h = jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
        jax.debug.callback(lambda a: seen.append(a.dtype), h)
        return jnp.tanh(h) @ w

    x, w = jnp.ones((8, 32)), jnp.ones((32, 32)) * 0.01
    out = jax.jit(amp(fn))(x, w)
    jax.block_until_ready(out)
    assert out.dtype == F32 and seen and all(np.dtype(d) == F32 for d in seen), seen
    dots = prim_dtypes(jax.make_jaxpr(amp(fn))(x, w), "dot_general")
    assert any(i == (BF16, BF16) for i, _, _ in dots)  # the matmuls still run low


# -- float64, complex and explicit precision are left as written ------------------------------


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def test_float64_and_complex_dots_are_not_lowered(x64):
    rng = np.random.default_rng(0)
    a32 = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    for other in (jnp.float64, jnp.complex64):
        b = jnp.asarray(rng.standard_normal((64, 64)), other)
        f = amp(lambda a, b: a @ b)
        np.testing.assert_array_equal(np.asarray(f(a32, b)), np.asarray(a32 @ b))
        rows = dtype_report(f, a32, b)
        assert [r[5] for r in rows if r[0] == "dot_general"] == ["float64/complex operand: not ours to lower"]


@pytest.mark.parametrize("precision", [lax.Precision.HIGHEST, lax.Precision.HIGH, "highest"])
def test_explicit_precision_stays_float32(precision):
    a, b = jnp.ones((64, 64)) / 3, jnp.ones((64, 64)) / 7
    f = amp(lambda a, b: jnp.dot(a, b, precision=precision) + a @ b)
    dots = sorted(i for i, _, _ in prim_dtypes(jax.make_jaxpr(f)(a, b), "dot_general"))
    assert dots == sorted([(F32, F32), (BF16, BF16)])
    why = {r[5] for r in dtype_report(f, a, b) if r[0] == "dot_general"}
    assert any("explicit precision" in w for w in why), why


def test_tiny_contractions_stay_float32_and_say_why():
    v, m, big = jnp.ones(32), jnp.ones((7, 8, 4)), jnp.ones((64, 64))
    f = amp(lambda v, m, big, c: (jnp.dot(v, v), jnp.einsum("s,sij->ij", c, m), big @ big))
    c = jnp.ones(7)
    dots = prim_dtypes(jax.make_jaxpr(f)(v, m, big, c), "dot_general")
    assert sorted(i for i, _, _ in dots) == sorted([(F32, F32), (F32, F32), (BF16, BF16)])
    reasons = [r[5] for r in dtype_report(f, v, m, big, c) if r[0] == "dot_general" and r[5]]
    assert len(reasons) == 1 and "too small" in reasons[0]
    low = amp(lambda v: jnp.dot(v, v), policy=Policy(min_low_contraction=0, min_low_flops=0))
    assert prim_dtypes(jax.make_jaxpr(low)(v), "dot_general")[0][0] == (BF16, BF16)


# -- configuration errors name the argument and the fix ------------------------------------


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(overrides=["exp"]), TypeError, r"overrides=\['exp'\] must map primitive names to classes"),
    (dict(full_precision_scopes=5), TypeError, "full_precision_scopes=5 must be jax.named_scope names"),
    (dict(allow=["dot_generl"]), ValueError, "did you mean 'dot_general'"),
    (dict(overrides={"tan_h": "deny"}), ValueError, "did you mean 'tanh'"),
    (dict(min_low_flops=-1), ValueError, r"min_low_flops=-1\) must be an int >= 0"),
    (dict(allow_outputs="bf16"), ValueError, "allow_outputs='bf16'"),
])
def test_policy_errors_name_the_argument(kwargs, err, match):
    with pytest.raises(err, match=match):
        Policy(**kwargs)


def test_unknown_but_unlike_any_name_is_accepted():
    # (a library's own primitive)
    assert "my_library_matmul" in Policy(allow=(*Policy().allow, "my_library_matmul")).allow


def test_strict_accepts_common_primitives():
    def fn(x, w):
        a, b = jnp.split(x @ w, 2, axis=-1)
        jax.debug.print("{}", jnp.sum(a))
        return jnp.sum(jnp.where(a <= b, a, b))

    x, w = jnp.ones((8, 32)), jnp.ones((32, 32))
    np.testing.assert_allclose(amp(fn, strict=True)(x, w), fn(x, w), rtol=1e-2)


# -- constants the compute dtype cannot represent ---------------------------------------


def test_float16_constants_out_of_range_keep_their_op_float32():
    x = w = jnp.ones((512, 512))
    f = lambda x, w: ((x @ w) * 1e-8) @ w  # noqa: E731  (1e-8 is 0 in float16)
    out = amp(f, policy="float16")(x, w)
    np.testing.assert_allclose(out, f(x, w), rtol=0.03)  # 0.0026, not 0
    why = [r for r in dtype_report(amp(f, policy="float16"), x, w) if r[5]]
    assert [(r[0], r[1], r[5]) for r in why] == [
        ("mul", "float32,float32", "reads a constant the compute dtype cannot represent")]

    def masked_pool(x, w):
        h = x @ w
        h = jnp.where(jnp.arange(h.shape[-1]) % 3 == 0, h, -1e9)  # the usual mask fill
        p = lax.reduce_window(h, -jnp.inf, lax.max, (1, 4), (1, 4), "VALID")
        return p @ w[: p.shape[-1]]

    x, w = jax.random.normal(jax.random.PRNGKey(0), (8, 64)), jax.random.normal(jax.random.PRNGKey(1), (64, 64)) / 8
    out = amp(masked_pool, policy="float16")(x, w)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, masked_pool(x, w), atol=0.02 * float(jnp.max(jnp.abs(out))))
    # bfloat16 represents both constants: nothing is kept
    assert not [r for r in dtype_report(amp(masked_pool), x, w) if r[5]]


def test_cache_size_is_an_option_and_checked():
    f = amp(lambda x: x * 2, cache_size=2)
    for n in (1, 2, 3, 1):
        f(jnp.ones(n))
    assert f.trace_count == 4  # the LRU of 2 dropped shape (1,)
    g = amp(lambda x: x * 2, cache_size=8)
    for n in (1, 2, 3, 1):
        g(jnp.ones(n))
    assert g.trace_count == 3
    with pytest.raises(ValueError, match="cache_size=0"):
        amp(lambda x: x, cache_size=0)
