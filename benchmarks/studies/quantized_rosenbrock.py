"""Frozen study; its results: benchmarks/results/QUANTIZED_STATES.md, "4-bit states on Rosenbrock" (2026-11-25).

Why 4-bit AdamW states stop short of Rosenbrock's minimum, and what closes the gap.

    python -m benchmarks.studies.quantized_rosenbrock [--steps 10000]

``adamw(0.1)`` for ``--steps`` steps on the Rosenbrock function (a=1, b=100)
of one parameter of shape (2,), from four starting points, with float32
states (``optax.adamw``) and with 8-bit, float8 and 4-bit states forced onto
that 2-element parameter (``min_quantized_size=1``: one block holds both
coordinates). The 4-bit variants: the shipped maps; ``mu`` rounded
stochastically too; a finer ``mu`` map near zero (powers of two down to
2**-6 instead of the dynamic map's three decades in 16 codes); a finer
``nu`` map near zero (``sqrt(nu)`` on powers of sqrt(2) down to 2**-7.5,
no zero, instead of the linear ``(i + 1) / 16``); each moment 4-bit with the
other 8-bit; and the default ``min_quantized_size`` (4096: the parameter
keeps float32 states). Prints the final point, its distance to (1, 1) and
the loss.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_jax import optim
from amp_jax.optim import _codes, _quantized

STARTS = ((0.0, 0.0), (-0.5, 0.5), (-1.2, 1.0), (2.0, 2.0))


def rosenbrock(p):
    x, y = p[0], p[1]
    return (1.0 - x) ** 2 + 100.0 * (y - x**2) ** 2


@dataclasses.dataclass(frozen=True)
class _TableCodec(_quantized._Codec):
    """A codec of kind "dynamic" looked up in a given sorted table."""

    values: tuple[float, ...] = ()

    @property
    def table(self):
        return np.asarray(self.values, np.float32)


_POW2_SIGNED = sorted({0.0, 0.75} | {s * 2.0**-k for k in range(7) for s in (1, -1)})  # 16 codes
_SQRT2_UNSIGNED = sorted(2.0 ** (-k / 2) for k in range(16))  # 1 ... 2**-7.5, no zero
MU_POW2 = _TableCodec("dynamic", 4, values=tuple(_POW2_SIGNED))
NU_SQRT2 = _TableCodec("dynamic", 4, sqrt=True, signed=False, values=tuple(_SQRT2_UNSIGNED))


@contextlib.contextmanager
def _patched(codecs=None, slow_decay=None):
    """Construct an optimizer with other codecs / the stochastic-rounding threshold."""
    # (the storage looks both up in amp_jax.optim._codes when it is traced)
    old = _codes.codecs, _codes.SLOW_DECAY
    if codecs is not None:
        _codes.codecs = lambda fmt: codecs
    if slow_decay is not None:
        _codes.SLOW_DECAY = slow_decay
    try:
        yield
    finally:
        _codes.codecs, _codes.SLOW_DECAY = old


def _variants():
    q = {"min_quantized_size": 1}
    m8, n8 = _quantized._codecs("8bit")
    # the 4-bit mu map this study questioned (shipped until 2026-11-27, when
    # the powers-of-two map, MU_POW2 here, replaced it)
    m4 = _quantized._Codec("dynamic", 4, exponent_bits=3)
    n4 = _quantized._codecs("4bit")[1]
    plain = lambda fmt, **kw: lambda: optim.adamw(0.1, state_format=fmt, **q, **kw)  # noqa: E731

    def patched(codecs=None, slow_decay=None, **kw):  # (traced in `run`, under the patch too)
        return lambda: optim.adamw(0.1, state_format="4bit", **q, **kw), (codecs, slow_decay)

    return {
        "float32 (optax.adamw)": lambda: optax.adamw(0.1),
        "8bit": plain("8bit"),
        "float8": plain("float8"),
        "4bit (dynamic mu map, shipped until 2026-11-27)": patched((m4, n4)),
        "4bit, nearest nu": patched((m4, n4), state_rounding="nearest"),
        "4bit, stochastic mu": patched((m4, n4), slow_decay=0.85),
        "4bit, finer mu map (2**-k)": patched((MU_POW2, n4)),
        "4bit, finer nu map (2**-k/2)": patched((m4, NU_SQRT2)),
        "4bit, both finer maps": patched((MU_POW2, NU_SQRT2)),
        "4bit mu, 8bit nu": patched((m4, n8)),
        "8bit mu, 4bit nu": patched((m8, n4)),
        "4bit, default min_quantized_size": lambda: optim.adamw(0.1, state_format="4bit"),
        "4bit (shipped: powers-of-two mu map)": plain("4bit"),
        "4bit (shipped), nearest nu": plain("4bit", state_rounding="nearest"),
    }


def run(tx, start, steps):
    def body(_, carry):
        p, s = carry
        u, s = tx.update(jax.grad(rosenbrock)(p), s, p)
        return optax.apply_updates(p, u), s

    p0 = jnp.asarray(start, jnp.float32)
    go = jax.jit(lambda p, s: jax.lax.fori_loop(0, steps, body, (p, s))[0])
    return np.asarray(go(p0, tx.init(p0)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--steps", type=int, default=10_000)
    args = ap.parse_args(argv)
    print(f"JAX {jax.__version__}, optax {optax.__version__}, {args.steps} steps, lr 0.1\n")
    head = " | ".join(f"from {s}: (x, y) ; dist ; loss" for s in STARTS)
    print(f"| states | {head} |\n|---|" + "---|" * len(STARTS))
    for name, make in _variants().items():
        cells = []
        make, patch = make if isinstance(make, tuple) else (make, (None, None))
        for start in STARTS:
            with _patched(*patch):
                p = run(make(), start, args.steps)
            dist, loss = np.hypot(*(p - 1.0)), float(rosenbrock(p))
            cells.append(f"({p[0]:.4f}, {p[1]:.4f}) ; {dist:.2g} ; {loss:.2g}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
