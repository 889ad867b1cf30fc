"""The one casting rule of amp (``casting.py``): a managed float is read in the
compute dtype only if it is wider; float32 ("high") reads are always float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amp_jax._src import casting, compat
from amp_jax._src.painting import HIGH, LOW, ORIG


@pytest.mark.parametrize(
    "dtype, color, expected",
    [
        (jnp.float32, LOW, jnp.bfloat16),
        (jnp.float16, LOW, jnp.float16),  # never widened: a float16 value stays float16
        (jnp.bfloat16, LOW, jnp.bfloat16),
        (jnp.bfloat16, HIGH, jnp.float32),
        (jnp.float32, ORIG, jnp.float32),
        (jnp.float16, ORIG, jnp.float16),
        (jnp.float64, LOW, None),  # not managed: read as it is
        (jnp.int32, LOW, None),
        (None, LOW, None),
    ],
)
def test_one_casting_rule(dtype, color, expected):
    got = casting.target(dtype, color, np.dtype(jnp.bfloat16))
    assert got == (None if expected is None else np.dtype(expected))


def test_cast_and_lower_make_no_convert_when_none_is_needed():
    x = jnp.ones(3, jnp.bfloat16)
    assert casting.cast(x, jnp.bfloat16) is x
    assert casting.cast(x, None) is x
    assert casting.lower(x, np.dtype(jnp.float16)) is x  # equal width: kept
    i = jnp.ones(3, jnp.int32)
    assert casting.lower(i, np.dtype(jnp.bfloat16)) is i
    assert casting.lower(jnp.ones(3), np.dtype(jnp.bfloat16)).dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda a: casting.cast(a, jnp.float32))(jnp.ones(2))
    assert not compat.jaxpr_of(jaxpr).eqns
