"""Never silently wrong: programs amp must get right or refuse, and the errors it gives."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import BF16, F32, allow_out_dtype, prim_dtypes
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from jax import lax

from amp_jax import Policy, amp, dtype_report, full_precision, optim

# -- plain objects holding arrays ---------------------------------------------------


class Model:
    def __init__(self, w):
        self.w = w

    @amp
    def __call__(self, h):
        return h @ self.w


def test_plain_object_holding_arrays_is_refused_not_baked_in():
    m, x = Model(jnp.ones((16, 16))), jnp.ones((8, 16))
    with pytest.raises(
        TypeError,
        match=r"amp\(Model.__call__\): argument `self` is a Model that holds "
        r"arrays \(`self.w`\).*pytree",
    ):
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


# -- configuration errors name the argument and the fix ------------------------------------


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (
            dict(overrides=["exp"]),
            TypeError,
            r"overrides=\['exp'\] must map primitive names to classes",
        ),
        (
            dict(full_precision_scopes=5),
            TypeError,
            "full_precision_scopes=5 must be jax.named_scope names",
        ),
        (dict(allow=["dot_generl"]), ValueError, "did you mean 'dot_general'"),
        (dict(overrides={"tan_h": "deny"}), ValueError, "did you mean 'tanh'"),
        # two swapped letters: the nearest name, not the most alike prefix ('tan')
        (dict(overrides={"tahn": "deny"}), ValueError, "did you mean 'tanh'"),
        (dict(min_low_flops=-1), ValueError, r"min_low_flops=-1\) must be an int >= 0"),
        (dict(allow_outputs="bf16"), ValueError, "allow_outputs='bf16'"),
    ],
)
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


# -- errors name the user's function and arguments (as jax.jit's do) -----------------


def test_tracing_errors_name_the_users_function_and_argument():
    @amp
    def my_loss(a, b):
        if a.sum() > 0:
            return a
        return b

    with pytest.raises(jax.errors.TracerBoolConversionError) as e:
        my_loss(PX, PW)
    msg = str(e.value)
    assert "my_loss" in msg and "test_errors.py" in msg and "argument a" in msg, msg
    assert "flat_fn" not in msg and "transform.py" not in msg

    @amp
    def by_tree(params, mode="train", *, scale):
        if params["w"].sum() > 0 and mode == "train":
            return params["w"] * scale
        return params["w"]

    with pytest.raises(jax.errors.TracerBoolConversionError, match=r"argument params\['w'\]"):
        by_tree({"w": PW}, "train", scale=2.0)

    @amp
    def returns_str(a):
        return "s"

    # (a string is returned as a static value, as eqx.filter_jit returns it;
    # a plain object that holds arrays is refused, naming the function)
    assert returns_str(PX) == "s"

    @dataclasses.dataclass
    class Out:
        v: jax.Array

    def returns_dataclass(a):
        return Out(a)

    with pytest.raises(TypeError, match="returns_dataclass"):
        amp(returns_dataclass)(PX)


def test_dtype_report_accepts_static_arguments():
    f = amp(lambda a, mode: a @ a if mode == "mm" else a)
    rows = dtype_report(f, PX, "mm")
    assert [r[:3] for r in rows if r[0] == "dot_general"] == [
        ("dot_general", "bfloat16,bfloat16", str(allow_out_dtype()))
    ]


# -- every public function validates its arguments up front ----------------------------


SGD = optax.sgd(0.1)


@pytest.mark.parametrize(
    "make,exc,parts",
    [
        (
            lambda: optim.dynamic_loss_scale(optax.adam),
            TypeError,
            ["dynamic_loss_scale", "`inner`", "'adam'", "optax.adam(1e-3)"],
        ),
        (lambda: optim.static_loss_scale(None, 2.0), TypeError, ["`inner`", "None"]),
        (lambda: optim.master_weights(optax.sgd), TypeError, ["master_weights", "`inner`"]),
        (lambda: optim.kahan_summation(3), TypeError, ["kahan_summation", "`inner`"]),
        (
            lambda: optim.stochastic_rounding(optax.sgd, 0),
            TypeError,
            ["stochastic_rounding", "`inner`"],
        ),
        (
            lambda: optim.dynamic_loss_scale(SGD, init_scale="big"),
            TypeError,
            ["`init_scale`", "'big'"],
        ),
        (
            lambda: optim.dynamic_loss_scale(SGD, growth_factor="2.0"),
            TypeError,
            ["`growth_factor`", "'2.0'"],
        ),
        (
            lambda: optim.dynamic_loss_scale(SGD, growth_interval=2.5),
            TypeError,
            ["`growth_interval`"],
        ),
        (lambda: optim.static_loss_scale(SGD, "8"), TypeError, ["`scale`"]),
        (
            lambda: optim.master_weights(SGD, master_dtype="float33"),
            ValueError,
            ["`master_dtype`", "'float33'"],
        ),
        (lambda: optim.kahan_summation(SGD, "float33"), ValueError, ["`compensation_dtype`"]),
        (
            lambda: optim.stochastic_rounding(SGD, jax.random.split(jax.random.key(0), 4)),
            ValueError,
            ["`key`", "single", "(4,)"],
        ),
        (
            lambda: optim.stochastic_rounding(SGD, jax.random.split(jax.random.PRNGKey(0), 4)),
            ValueError,
            ["`key`", "single"],
        ),
        (lambda: optim.stochastic_rounding(SGD, "seed"), TypeError, ["`key`"]),
        (lambda: optim.adamw("1e-3"), TypeError, ["adamw", "`learning_rate`"]),
        (lambda: optim.adamw(1e-3, b1="0.9"), TypeError, ["`b1`"]),
        (lambda: optim.adamw(1e-3, kahan="yes"), TypeError, ["`kahan`"]),
        (lambda: optim.scale_by_any_precision_adam(eps=None), TypeError, ["`eps`"]),
        (
            lambda: optim.scaled_value_and_grad(
                lambda p: p, optim.static_loss_scale(SGD, 2.0).init(1.0), has_aux="no"
            ),
            TypeError,
            ["`has_aux`"],
        ),
    ],
)
def test_optim_errors_name_argument_and_value(make, exc, parts):
    with pytest.raises(exc) as e:
        make()
    for part in parts:
        assert part in str(e.value), str(e.value)


def test_optim_accepts_numpy_numbers_and_schedules():
    tx = optim.dynamic_loss_scale(SGD, growth_interval=np.int64(10), init_scale=np.float32(2.0**10))
    assert float(optim.loss_scale(tx.init(jnp.ones(2)))) == 2.0**10
    optim.adamw(optax.linear_schedule(1e-3, 0.0, 10), b1=np.float32(0.9))
    optim.stochastic_rounding(SGD, np.int64(3))


# -- smaller -------------------------------------------------------------------------------


def test_constant_outputs_come_back_as_f_and_jit_return_them():
    fn = lambda: (3, np.ones(2, np.float32), 2.5, True)  # noqa: E731
    ours, plain, jitted = amp(fn)(), fn(), jax.jit(fn)()
    # Python scalars as ``fn`` (and eqx.filter_jit) return them; NumPy arrays as jax.jit does
    for i in (0, 2, 3):
        assert type(ours[i]) is type(plain[i]) and ours[i] == plain[i], (ours[i], plain[i])
    o, t = ours[1], jitted[1]
    assert type(o) is type(t), (type(o), type(t))
    assert o.dtype == t.dtype and o.weak_type == t.weak_type


def test_scaled_value_and_grad_allow_int():
    state = optim.static_loss_scale(SGD, 4.0).init({"w": jnp.ones(2)})

    def loss(p):
        return jnp.sum(p["w"] * p["n"])

    p = {"w": jnp.ones(2), "n": jnp.arange(2)}
    with pytest.raises(TypeError):
        optim.scaled_value_and_grad(loss, state)(p)
    val, g = optim.scaled_value_and_grad(loss, state, allow_int=True)(p)
    assert float(val) == 1.0 and g.grads["w"].tolist() == [0.0, 4.0]
    assert g.grads["n"].dtype == jax.dtypes.float0


def test_strict_knows_more_primitives():
    for name in (
        "io_callback",
        "debug_callback",
        lax.scatter_add_p.name,
        lax.scatter_max_p.name,
        "le_to",
        "lt_to",
        "eq_to",
        "ffi_call",
    ):
        assert Policy().class_of(name) is not None, name
    assert Policy().class_of(lax.scatter_add_p.name) == "follow"


# -- property: right answer or a clear refusal -------------------------------------------
#
# Random chains of default-precision dots, host callbacks, explicit-precision
# dots, float64 and complex dots (under x64) and a plain object holding an
# array. amp either refuses the plain object, naming the function, the
# argument and the fix, or gives a result no further from float32 than the
# same program with its default-precision dots cast to bf16 by hand; with no
# default-precision dot the result is float32's.

PX = jax.random.normal(jax.random.PRNGKey(0), (16, 16)) / 4
PW = jax.random.normal(jax.random.PRNGKey(1), (16, 16)) / 4

_PIECES = st.lists(
    st.sampled_from(
        ["dot", "callback", "debug", "highest", "high", "f64", "complex", "tanh", "plain"]
    ),
    min_size=1,
    max_size=5,
)


class _Plain:
    def __init__(self, w):
        self.w = w


def _run(pieces, x, w, holder, mm):
    h = x
    for p in pieces:
        if p == "dot":
            h = mm(h, w)
        elif p == "callback":
            h = jax.pure_callback(
                lambda v: np.asarray(v) * 1.0, jax.ShapeDtypeStruct(h.shape, h.dtype), h
            )
        elif p == "debug":
            jax.debug.callback(lambda v: None, h)
        elif p == "highest":
            h = jnp.dot(h, w, precision=lax.Precision.HIGHEST)
        elif p == "high":
            h = jnp.dot(h, w, precision=lax.Precision.HIGH)
        elif p == "f64":
            h = (h @ w.astype(jnp.float64)).astype(jnp.float32)
        elif p == "complex":
            h = jnp.real(h.astype(jnp.complex64) @ w)
        elif p == "tanh":
            h = jnp.tanh(h)
        elif p == "plain":
            h = h + holder.w
    return h


@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(_PIECES)
def test_random_program_right_or_refused(pieces):
    def hand_mm(a, b):  # what amp may do to a default-precision float32 dot
        return jnp.matmul(
            a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32
        )

    holder = _Plain(jnp.full((16, 16), 0.01))

    def prog(x, w, holder):
        return _run(pieces, x, w, holder, lambda a, b: a @ b)

    with jax.enable_x64(True):
        x, w = PX, PW
        # a plain object argument: refused (whether or not the program reads it)
        with pytest.raises(TypeError, match=r"prog.*`holder`.*pytree"):
            amp(prog)(x, w, holder)
        out = amp(lambda x, w, hw: prog(x, w, _Plain(hw)))(x, w, holder.w)
        ref = prog(x, w, holder)
        hand = _run(pieces, x, w, holder, hand_mm)
        jax.effects_barrier()
        assert out.dtype == ref.dtype == F32
        # within the compute dtype's floor: no further from float32 than the
        # program with its default-precision dots cast to bf16 by hand
        err, hand_err = float(jnp.max(jnp.abs(out - ref))), float(jnp.max(jnp.abs(hand - ref)))
        scale = float(jnp.max(jnp.abs(ref))) + 1e-6
        assert err <= hand_err + 1e-2 * scale, (pieces, err, hand_err)
        if "dot" not in pieces:  # every matmul is explicit-precision, float64 or complex
            assert err <= 1e-6 * scale, (pieces, err)


def test_positional_policy_names_the_keyword():
    f = lambda x: x @ x
    with pytest.raises(TypeError, match=r"amp\(fn, policy='float16'\)"):
        amp(f, "float16")


# -- habits from other libraries get an answer that shows amp's form -----------------------


@pytest.mark.parametrize(
    "make, shown",
    [
        (lambda: amp(), "@amp\n"),
        (lambda: amp(policy="float16"), "@amp(policy='float16')"),
        (lambda: full_precision(), "@full_precision\n"),
    ],
    ids=["amp", "amp-float16", "full_precision"],
)
def test_with_amp_explains_the_function_form(make, shown):
    # torch.autocast is a context manager; amp transforms functions
    with pytest.raises(TypeError, match="is not a context manager") as info:
        with make():
            pass
    assert shown in str(info.value)
    # the same object still decorates
    f = make()(lambda a, b: a @ b)
    assert f(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype == jnp.float32


def test_errors_quote_a_summary_of_a_large_argument():
    params = {f"w{i}": jnp.ones((256,)) for i in range(10)}
    with pytest.raises(TypeError, match=r"got dict: a dict with keys \['w0',") as info:
        amp(params)
    assert len(str(info.value)) < 300 and "Array(" not in str(info.value)
    with pytest.raises(TypeError, match=r"shape \(1000,\) and dtype float32") as info:
        full_precision(jnp.ones(1000))
    assert len(str(info.value)) < 200


def test_signature_shows_no_private_names():
    import inspect

    sig = inspect.signature(amp)
    assert sig.parameters["cache_size"].default == 64
    assert [p.kind for p in sig.parameters.values()][1:] == [inspect.Parameter.KEYWORD_ONLY] * 3
