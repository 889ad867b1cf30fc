"""amp_jax.eager._deps.dependencies: which inputs each output of a jaxpr reads.

Table-driven: a function of inputs labelled ``a``, ``b``, ``c`` in, the exact
set of labels of each output out. Call-like primitives (jit, checkpoint,
custom_jvp/vjp) are entered; other higher-order primitives (scan) make each
output depend on all of their operands.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from amp_jax._src import compat
from amp_jax.eager._deps import dependencies

A, B, C = frozenset("a"), frozenset("b"), frozenset("c")
NONE = frozenset()


def _two(a, b):
    return a * 2.0, jnp.sin(b)


@jax.custom_vjp
def _vjp_two(a, b):
    return a * 3.0, b + 1.0


_vjp_two.defvjp(lambda a, b: ((a * 3.0, b + 1.0), None), lambda _, g: (g[0] * 3.0, g[1]))


@jax.custom_jvp
def _jvp_two(a, b):
    return jnp.exp(a), b * b


_jvp_two.defjvp(lambda p, t: (_jvp_two(*p), (jnp.exp(p[0]) * t[0], 2 * p[1] * t[1])))


def _scan(a, b, c):
    carry, ys = lax.scan(lambda h, x: (h * x, h + 1.0), a, jnp.stack([b, b]))
    return carry, ys[0], c


CASES = {
    "independent": (lambda a, b, c: (a + 1.0, b * c, jnp.sin(a) * a), [A, B | C, A]),
    "passthrough_and_swap": (lambda a, b, c: (c, b, a), [C, B, A]),
    "mixed": (lambda a, b, c: (a * b + c,), [A | B | C]),
    "literal_only": (lambda a, b, c: (jnp.float32(2.0) * 3.0, a), [NONE, A]),
    "zeros_like": (lambda a, b, c: (jnp.zeros(3) + 1.0, b), [NONE, B]),
    "jit_entered": (lambda a, b, c: (*jax.jit(_two)(a, b), c), [A, B, C]),
    "nested_jit": (lambda a, b, c: jax.jit(lambda u, v, w: jax.jit(_two)(u, w))(a, b, c), [A, C]),
    "checkpoint_entered": (lambda a, b, c: jax.checkpoint(_two)(b, c), [B, C]),
    "relu_custom_jvp": (lambda a, b, c: (jax.nn.relu(a), b), [A, B]),
    "custom_jvp_two_args": (lambda a, b, c: _jvp_two(a, c), [A, C]),
    "custom_vjp_two_args": (lambda a, b, c: _vjp_two(c, a), [C, A]),
    "scan_conservative": (_scan, [A | B, A | B, C]),
    "cond_conservative": (
        lambda a, b, c: lax.cond(a[0] > 0, lambda u, v: (u, v), lambda u, v: (v, u), a, b),
        [A | B, A | B],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dependencies_table(name):
    fn, expected = CASES[name]
    x = jnp.linspace(-1.0, 1.0, 3)
    closed = jax.make_jaxpr(fn)(x, x, x)
    # a closed jaxpr and its open jaxpr give the same answer
    assert dependencies(closed, [A, B, C]) == expected
    assert dependencies(compat.jaxpr_of(closed), [A, B, C]) == expected


def test_labels_are_unions_of_the_given_sets():
    x = jnp.ones(2)
    closed = jax.make_jaxpr(lambda u, v: (u + v, v))(x, x)
    assert dependencies(closed, [frozenset({0, 1}), frozenset({7})]) == [
        frozenset({0, 1, 7}),
        frozenset({7}),
    ]
