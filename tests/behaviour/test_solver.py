"""amp around a loss that contains numerical machinery: an adaptive ODE solve.

A neural ODE solved with Dormand-Prince 5(4) and a PI step-size controller
(as diffrax does it), written in plain JAX with a bounded loop so that it is
reverse-differentiable. With ``amp`` around the *whole* loss, the vector
field's matmuls must go bf16 while the solver's own contractions (7 stage
weights against the stacked stages) stay float32: the embedded error
estimate is a cancellation of nearly equal stage sums, noise in bf16. The
reference is the same solve with only the field's matmul operands cast by
hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
from _util import BF16, F32, prim_dtypes, rel

from amp_jax import amp, dtype_report

# Dormand-Prince 5(4) tableau
C = np.array([0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1, 1])
A = np.zeros((7, 7))
A[1, :1] = [1 / 5]
A[2, :2] = [3 / 40, 9 / 40]
A[3, :3] = [44 / 45, -56 / 15, 32 / 9]
A[4, :4] = [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729]
A[5, :5] = [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656]
A[6, :6] = [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]
B5 = A[6].copy()
B4 = np.array([5179 / 57600, 0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40])
A, B5, BERR = (jnp.asarray(a, jnp.float32) for a in (A, B5, B5 - B4))

BATCH, DIM, WIDTH, MAX_STEPS = 8, 16, 64, 24


def field(params, y, hand):
    w1, b1, w2 = params
    if hand:  # matmul operands cast by hand, float32 accumulation
        bf = jnp.bfloat16
        h = jnp.tanh(jnp.matmul(y.astype(bf), w1.astype(bf), preferred_element_type=F32) + b1)
        return jnp.matmul(h.astype(bf), w2.astype(bf), preferred_element_type=F32)
    return jnp.tanh(y @ w1 + b1) @ w2


def solve(params, y0, hand=False, t1=1.0, rtol=1e-3, atol=1e-6):
    def step(carry, _):
        t, y, h, prev, acc, rej = carry
        active = t < t1
        h = jnp.minimum(h, t1 - t)
        ks = jnp.zeros((7, *y.shape), y.dtype)
        for i in range(7):
            yi = y + h * jnp.einsum("s,sij->ij", A[i], ks)
            ks = ks.at[i].set(field(params, yi, hand))
        y_new = y + h * jnp.einsum("s,sij->ij", B5, ks)
        err = h * jnp.einsum("s,sij->ij", BERR, ks)
        scale = atol + rtol * jnp.maximum(jnp.abs(y), jnp.abs(y_new))
        enorm = jnp.sqrt(jnp.mean(jnp.square(err / scale)) + 1e-20)
        ok = (enorm <= 1.0) & active
        # (the step size is not differentiated through, as in diffrax)
        safe = jax.lax.stop_gradient(jnp.maximum(enorm, 1e-4))
        factor = jnp.clip(0.9 * safe ** (-0.7 / 5) * prev ** (0.4 / 5), 0.2, 10.0)
        t = jnp.where(ok, t + h, t)
        y = jnp.where(ok, y_new, y)
        prev = jnp.where(ok, safe, prev)
        h = jnp.where(active, h * factor, h)
        acc, rej = acc + ok, rej + (~ok & active)
        return (t, y, h, prev, acc, rej), None

    init = (jnp.float32(0), y0, jnp.float32(0.1), jnp.float32(1.0), jnp.int32(0), jnp.int32(0))
    (t, y, _, _, acc, rej), _ = jax.lax.scan(step, init, None, length=MAX_STEPS)
    return y, (acc, rej, t)


def loss(params, y0, hand=False):
    y, stats = solve(params, y0, hand)
    return jnp.mean(jnp.square(y)), stats


def _setup():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = (
        jax.random.normal(k[0], (DIM, WIDTH)) / np.sqrt(DIM),
        jax.random.normal(k[1], (WIDTH,)) * 0.1,
        jax.random.normal(k[2], (WIDTH, DIM)) * 2.0 / np.sqrt(WIDTH),
    )
    y0 = jax.random.normal(k[3], (BATCH, DIM))
    return params, y0


def _run(fn, params, y0):
    (value, stats), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, y0)
    return (
        float(value),
        [int(s) for s in stats[:2]],
        float(stats[2]),
        jnp.concatenate([jnp.ravel(g) for g in grads]),
    )


def test_amp_around_the_whole_solve_is_as_good_as_casting_the_field_by_hand():
    params, y0 = _setup()
    v32, steps32, t32, g32 = _run(loss, params, y0)
    vh, steps_h, th, gh = _run(lambda p, y: loss(p, y, hand=True), params, y0)
    va, steps_a, ta, ga = _run(amp(loss), params, y0)
    assert t32 == th == ta == 1.0  # every solve reached t1 within the step budget
    err_hand, err_amp = abs(vh - v32) / abs(v32), abs(va - v32) / abs(v32)
    gerr_hand, gerr_amp = rel(gh, g32), rel(ga, g32)
    assert err_amp <= 2 * err_hand + 1e-4, (err_amp, err_hand)
    assert gerr_amp <= 2 * gerr_hand + 1e-3, (gerr_amp, gerr_hand)
    assert abs(steps_a[0] - steps_h[0]) <= 1 and abs(steps_a[1] - steps_h[1]) <= 1, (
        steps_a,
        steps_h,
    )


def test_the_solver_contractions_stay_float32_and_the_field_goes_low():
    params, y0 = _setup()
    jaxpr = jax.make_jaxpr(amp(loss))(params, y0)
    dots = prim_dtypes(jaxpr, "dot_general")
    stage_dots = [d for d in dots if d[0] == (F32, F32)]
    field_dots = [d for d in dots if d[0] == (BF16, BF16)]
    assert len(field_dots) == 14  # two matmuls per stage, 7 stages
    assert len(stage_dots) == 9  # 7 stage sums, the solution and the error estimate
    why = {
        r[5]
        for r in dtype_report(amp(loss), params, y0)
        if r[0] == "dot_general" and r[1].startswith("float32")
    }
    assert why == {"too small to pay (Policy.min_low_contraction / min_low_flops)"}


def test_odeint_with_constant_times_differentiates_under_amp():
    # The times of a solve written as a constant (jnp.array([0., 5.])) are a
    # NumPy constant of amp's trace; odeint's custom_vjp saves them for its
    # backward rule, which indexes them with its scan's counter: amp handed
    # them to the rule as a static NumPy array, and ``ts[i]`` raised
    # TracerArrayConversionError (JAX's ode_test test_odeint_vmap_grad)
    from jax.experimental.ode import odeint

    def loss(x):
        times = jnp.array([0.0, 5.0])
        ys = jax.vmap(lambda y0: odeint(lambda y, t: 0.1 * y, y0, times))(
            jnp.stack([jnp.stack([x, 0.1]), jnp.stack([x, 0.2])])
        )
        return ys[:, -1].sum()

    want = jax.grad(loss)(2.0)
    for policy in ("bfloat16", "float16"):
        np.testing.assert_allclose(jax.grad(amp(loss, policy=policy))(2.0), want, rtol=1e-2)
