"""amp's interpreter forced on at float32 (amp_jax/_src/testing.py), the mode in
which benchmarks/jax_suite.py runs JAX's, Equinox's and Flax NNX's own tests,
that runner's plugin (it wraps what a test passes to each library's
transformations) and its skip lists.

The forced interpreter must give the function's own results bit for bit, and
must really interpret: a hook that fell back to calling the function would
pass the first tests and fail the ones that look at the rewritten program.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from amp_jax._src.testing import INTERPRETED_FLOAT32, interpreted_float32

ROOT = pathlib.Path(__file__).resolve().parents[2]
W = jax.random.normal(jax.random.PRNGKey(0), (16, 16)) / 4
X = jax.random.normal(jax.random.PRNGKey(1), (8, 16))


def mlp(w, x):
    return jnp.mean(jax.nn.gelu(x @ w) ** 2)


def looped(w, x):
    def body(c, xi):
        return c * 0.9 + jnp.sin(xi @ w).sum(), c

    c, cs = lax.scan(body, 0.0, x)
    return c + lax.cond(c > 0, lambda: cs.sum(), lambda: -cs.sum())


def solved(w, x):
    a = w @ w.T + 16 * jnp.eye(16)
    y = jax.scipy.linalg.solve(a, x.T)
    return jnp.sum(jnp.tanh(y) ** 2)


@pytest.mark.parametrize("fn", [mlp, looped, solved], ids=lambda f: f.__name__)
@pytest.mark.parametrize("transform", ["call", "jit", "grad", "jit_grad", "vmap"])
def test_forced_float32_is_bitwise_the_function(fn, transform):
    t = {
        "call": lambda f: f,
        "jit": jax.jit,
        "grad": jax.grad,
        "jit_grad": lambda f: jax.jit(jax.grad(f)),
        "vmap": lambda f: jax.vmap(f, in_axes=(None, 0)),
    }[transform]
    x = X[:, None] if transform == "vmap" else X
    want, got = t(fn)(W, x), t(interpreted_float32(fn))(W, x)
    assert got.dtype == want.dtype
    if fn is solved and transform == "grad":
        # eagerly, JAX runs its jitted _lu_solve as one compiled program, amp
        # (which inlines plain jits, planning.prepare) runs it op by op: XLA
        # rounds the fused and unfused programs differently (1 ulp here)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_forced_float32_really_interprets():
    # (a function of its own: one of mlp shares the traces the tests above made)
    g = interpreted_float32(lambda w, x: mlp(w, x))
    assert not INTERPRETED_FLOAT32.is_identity
    g(W, X)
    assert g.trace_count == 1
    # the dot went through amp's dot rule (its custom_jvp for the backward
    # pass), which the identity policy never applies
    text = str(jax.make_jaxpr(g)(W, X))
    assert "amp_dot" in text, text
    assert "amp_dot" not in str(jax.make_jaxpr(mlp)(W, X))
    # and nothing was cast: every float in the program is float32
    assert "bf16" not in text and "convert_element_type[new_dtype=bfloat16" not in text


@pytest.mark.parametrize("suite", ["jax", "equinox", "flax_nnx"])
@pytest.mark.parametrize("listing", ["skips", "known"])
def test_jax_suite_skip_list_has_a_reason_on_every_line(suite, listing):
    import benchmarks.jax_suite as runner

    for mode, glob, kind, reason in runner.read_skips(getattr(runner.SUITES[suite], listing)):
        assert mode in ("*", "float32", "bfloat16"), (mode, glob)
        assert kind == "" or kind.endswith("Error"), (glob, kind)
        assert "::" in glob and len(reason) > 10, (glob, reason)


def _library_transforms():
    from benchmarks import _jax_suite_plugin as plugin

    return [
        (module, name)
        for suite in ("equinox", "flax_nnx")
        for module, names in plugin.TARGETS[suite]
        for name in names
    ]


@pytest.mark.parametrize("target", _library_transforms(), ids="{0[0]}.{0[1]}".format)
def test_jax_suite_plugin_wraps_the_libraries_transformations(target, monkeypatch):
    # what a test file hands eqx.filter_* and nnx.* runs under amp: the jitted
    # program holds amp's dot rule, and amp traces the function to a jaxpr
    # where grad and vmap alone pass JVP or batch tracers
    import importlib

    from benchmarks import _jax_suite_plugin as plugin

    module_name, name = target
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    monkeypatch.setattr(plugin, "MODE", "float32")
    monkeypatch.setattr(plugin, "_test_dirs", (str(pathlib.Path(__file__).parent),))
    seen = []

    def loss(w, x):
        seen.append(type(w).__name__)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    kwargs = {"in_axes": (None, 0)} if "vmap" in name else {}
    x = X[:, None] if "vmap" in name else X
    done = plugin.patch("jax,equinox,flax_nnx")
    try:
        transform = getattr(module, name)
        assert transform is not original and transform._amp_jax_suite_original is original
        if "jit" in name:  # the decorator factory (keyword arguments only) too
            text = str(jax.make_jaxpr(lambda x: transform()(loss)(W, x))(X))
        else:
            transform(loss, **kwargs)(W, x)
    finally:
        plugin.unpatch(done)
    assert getattr(module, name) is original
    if "jit" in name:
        assert "amp_dot" in text, text
        assert "amp_dot" not in str(jax.make_jaxpr(lambda x: original(loss)(W, x))(X))
    else:
        assert seen == ["DynamicJaxprTracer"], seen
        seen.clear()
        original(loss, **kwargs)(W, x)
        assert seen != ["DynamicJaxprTracer"], seen
