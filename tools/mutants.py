"""Named mutants of amp_jax: does some test fail when a feature is gone?

    python tools/mutants.py                 # every mutant, against the core test files
    python tools/mutants.py hoisting_off    # one mutant
    python tools/mutants.py --list          # the mutants' names
    python tools/mutants.py --identity      # the identity check
    python tools/mutants.py --help          # this text

Each mutant replaces one feature by a no-op (monkeypatched at import time
through ``tests/conftest.py`` when ``AMP_JAX_MUTANT`` is set) and runs the
core test files with ``-x``: the mutant is *killed* when a test fails,
*survives* when all pass. The script exits non-zero if any mutant survives.
A killed mutant stops at its first failing test. A mutant whose target no
longer exists (the code moved) stops the run before any test, naming it.

The identity check runs `IDENTITY_TESTS` with amp replaced by the identity
(no ``-x``) and fails when more than `MAX_IDENTITY_SHARE` of them pass.
The last results are in docs/contributing.md.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

CORE_TESTS = [
    "tests/test_transform.py",
    "tests/repository/test_performance_structure.py",
    "tests/test_policy.py",
    "tests/test_compat.py",
    "tests/test_optim_kahan_sr.py",
    "tests/test_optim_master.py",
    "tests/behaviour/test_random_programs.py",
    "tests/behaviour/test_ops.py",
    "tests/test_eager.py",
    "tests/test_attention.py",
    "tests/behaviour/test_errors.py",
    "tests/behaviour/test_solver.py",
    "tests/test_painting.py",
    "tests/test_planning.py",
    "tests/test_casting.py",
    "tests/test_float8.py",
    "tests/test_table.py",
    "tests/test_rules.py",
]


#: the tests of the identity check: with amp replaced by the identity, at most
#: `MAX_IDENTITY_SHARE` of them may pass (a test that passes without amp tests nothing of it)
IDENTITY_TESTS = [
    "tests/test_transform.py",
    "tests/behaviour/test_ops.py",
    "tests/behaviour/test_layers.py",
    "tests/behaviour/test_random_programs.py",
    "tests/repository/test_performance_structure.py",
]
MAX_IDENTITY_SHARE = 0.2


def _patch(owner: object, name: str, value: object) -> None:
    """``setattr(owner, name, value)``, refusing a name ``owner`` does not have.

    A mutant whose target moved would otherwise set a new, unused attribute
    and survive (or be killed) for no reason; it fails loudly instead.
    """
    if not hasattr(owner, name):
        raise SystemExit(f"mutant target {owner!r}.{name} does not exist: update tools/mutants.py")
    setattr(owner, name, value)


def _patch_item(mapping: dict, key: object, value: object) -> None:
    """``mapping[key] = value`` for a key ``mapping`` has (see `_patch`)."""
    if key not in mapping:
        raise SystemExit(f"mutant target [{key!r}] is not in the table: update tools/mutants.py")
    mapping[key] = value


def _amp_identity():
    from amp_jax._src import transform

    def call(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    _patch(transform.AmpFunction, "__call__", call)


def _hoisting_off():
    from amp_jax._src.rules import higher_order

    _patch(higher_order, "_plan_hoisted_casts", lambda ctx, eqn, d: None)


def _broadcast_reads_off():
    from amp_jax._src.rules import base

    _patch(
        base.CastingEnv, "read_broadcast", lambda self, atom, dtype, shape: self.read(atom, dtype)
    )


def _cache_off():
    from amp_jax._src import context

    _patch(context.Context, "cached", lambda self, kind, obj, make: make())


def _cpu_layouts_off():
    import dataclasses

    from amp_jax._src import backends

    # XLA:CPU's dots written as they are, with no planned layouts
    cpu = backends._BACKENDS["cpu"]
    _patch_item(
        backends._BACKENDS,
        "cpu",
        dataclasses.replace(cpu, dot=backends.plain_dot, plan_layouts=backends._no_layouts),
    )


def _painting_off():
    from amp_jax._src import painting
    from amp_jax._src.decision import Color, OpClass

    orig = painting.paint

    def paint(classes, jaxpr, *args, **kwargs):
        colors = orig(classes, jaxpr, *args, **kwargs)
        return [
            Color.ORIG if c is Color.LOW and k is not OpClass.ALLOW else c
            for c, k in zip(colors, classes)
        ]

    _patch(painting, "paint", paint)


def _custom_jvp_transparency_off():
    from amp_jax._src import classify

    _patch(classify, "is_transparent", lambda ctx, eqn: False)


def _low_backward_off():
    import amp_jax  # noqa: F401  (every module has registered its rules)
    from amp_jax._src.rules import base, table

    # the default allow rule: low forward, JAX's own (mixed, float32) transposes
    _patch_item(table.TABLE, "dot_general", base.AllowRule())
    _patch_item(table.TABLE, "conv_general_dilated", base.AllowRule())


def _explicit_rounding_off():
    from amp_jax.optim import _rounding

    _patch(_rounding, "round_nearest", lambda x, dtype: x.astype(dtype).astype(x.dtype))


def _thresholds_off():
    from amp_jax._src import classify
    from amp_jax._src.decision import Why

    orig = classify.stays_high

    def stays_high(eqn, policy):
        why = orig(eqn, policy)
        return None if why is Why.TOO_SMALL else why

    _patch(classify, "stays_high", stays_high)


def _decisions_off():
    from amp_jax._src import control

    _patch(control, "decision_slice", lambda *args, **kwargs: (set(), set(), set()))


def _attention_off():
    from amp_jax._src.attention import recognise

    _patch(recognise, "find", lambda jaxpr, consts, near=None: {})


def _low_outputs_off():
    from amp_jax._src import policy
    from amp_jax._src.rules.dots import outputs

    _patch(outputs, "allow_output_dtype", lambda pol, backend: policy.HIGH_DTYPE)


def _float8_off():
    from amp_jax._src.rules.dots import float8

    # the plan never picks the fp8 variant
    _patch(float8, "applies", lambda policy, vjp_rules, eqn: False)


def _float8_scales_unguarded():
    import jax.numpy as jnp

    from amp_jax._src.rules.dots import float8

    def scale_of(x, dtype, axes=None):  # amax / fp8_max: no floor, no inf/nan handling
        a = jnp.abs(x.astype(jnp.float32))
        amax = jnp.max(a) if axes is None else jnp.max(a, axis=axes, keepdims=True)
        return amax / float(jnp.finfo(dtype).max)

    _patch(float8, "scale_of", scale_of)


def _float8_backward_e4m3():
    from amp_jax._src.rules.dots import float8

    _patch(float8, "BWD_DTYPE", float8.FWD_DTYPE)


def _casting_widens():
    import numpy as np

    from amp_jax._src import casting

    _patch(casting, "narrowed", lambda dtype, compute_dtype: np.dtype(compute_dtype))  # f16 -> bf16


def _backend_from_process():
    from amp_jax._src import backends, context

    # the context asks the process, not the record it was configured with (the
    # record's field is written, and never read)
    if "backend" not in context.Context.__dataclass_fields__:
        raise SystemExit("mutant target Context.backend does not exist: update tools/mutants.py")
    context.Context.backend = property(  # type: ignore[assignment]
        lambda self: backends.current(), lambda self, value: None
    )


def _body_hints_off():
    from amp_jax._src import planning
    from amp_jax._src.decision import NO_HINTS

    # sub-jaxprs planned without what their parent's plan says of their outputs
    _patch(planning, "body_hints", lambda eqn, d, sub: NO_HINTS)


def _eager_state_carried():
    from amp_jax.eager import _scan_step

    _patch(_scan_step, "_carries_state", lambda: True)  # the pipelined state slice everywhere


def _eager_writes_unordered():
    from amp_jax.eager import _scan_step

    _patch(_scan_step, "_after", lambda i, stacks: i)  # state writes not ordered after the others


MUTANTS = {
    "amp_identity": _amp_identity,
    "hoisting_off": _hoisting_off,
    "broadcast_reads_off": _broadcast_reads_off,
    "cache_off": _cache_off,
    "cpu_layouts_off": _cpu_layouts_off,
    "painting_off": _painting_off,
    "decisions_off": _decisions_off,
    "custom_jvp_transparency_off": _custom_jvp_transparency_off,
    "low_backward_off": _low_backward_off,
    "explicit_rounding_off": _explicit_rounding_off,
    "low_outputs_off": _low_outputs_off,
    "thresholds_off": _thresholds_off,
    "attention_off": _attention_off,
    "float8_off": _float8_off,
    "float8_scales_unguarded": _float8_scales_unguarded,
    "float8_backward_e4m3": _float8_backward_e4m3,
    "casting_widens": _casting_widens,
    "backend_from_process": _backend_from_process,
    "body_hints_off": _body_hints_off,
    "eager_state_carried": _eager_state_carried,
    "eager_writes_unordered": _eager_writes_unordered,
}


def apply(name: str) -> None:
    """Applies mutant ``name`` (called from conftest.py before any test runs)."""
    if name not in MUTANTS:
        raise SystemExit(f"AMP_JAX_MUTANT={name!r} is not a mutant; choose from {sorted(MUTANTS)}")
    MUTANTS[name]()


def _pytest(name: str, tests: list[str], *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``tests`` under mutant ``name``: ``(the finished process, seconds)``."""
    env = {**os.environ, "AMP_JAX_MUTANT": name}
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *flags, *tests]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def _check_targets(names: list[str]) -> None:
    """Applies every mutant in ``names`` here, once, so a stale target fails before any run."""
    sys.path.insert(0, str(ROOT))
    for name in names:
        apply(name)


def run_mutants(names: list[str]) -> int:
    """Runs each mutant against `CORE_TESTS` with ``-x``; 1 if one survives."""
    _check_targets(names)
    survived = []
    print("| mutant | result | first failing test | seconds |\n|---|---|---|---:|", flush=True)
    for name in names:
        proc, seconds = _pytest(name, CORE_TESTS, "-x")
        failed = [
            line.split()[1]
            for line in proc.stdout.splitlines()
            if line.startswith(("FAILED", "ERROR"))
        ]
        killed = proc.returncode != 0
        if not killed:
            survived.append(name)
        first = failed[0] if failed else ("-" if not killed else f"(exit {proc.returncode})")
        result = "killed" if killed else "SURVIVED"
        print(f"| {name} | {result} | {first} | {seconds:.0f} |", flush=True)
    return 1 if survived else 0


def identity_check() -> int:
    """Runs `IDENTITY_TESTS` with amp replaced by the identity; 1 if over 20% pass."""
    _check_targets(["amp_identity"])
    proc, seconds = _pytest("amp_identity", IDENTITY_TESTS, "-rp")
    counts = dict.fromkeys(("passed", "failed", "error", "errors"), 0)
    for n, word in re.findall(r"(\d+) (passed|failed|errors?)\b", proc.stdout.splitlines()[-1]):
        counts[word] += int(n)
    passed = counts["passed"]
    total = passed + counts["failed"] + counts["error"] + counts["errors"]
    share = passed / max(total, 1)
    print(
        f"amp replaced by the identity: {passed} of {total} tests pass ({share:.0%}; {seconds:.0f} s)"
    )
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("PASSED")))
    return 1 if total == 0 or share > MAX_IDENTITY_SHARE else 0


def main(argv: list[str]) -> int:
    options = [a for a in argv if a.startswith("-")]
    names = [a for a in argv if not a.startswith("-")]
    unknown = sorted(set(options) - {"--help", "-h", "--list", "--identity"})
    if unknown or {"--help", "-h"} & set(options):
        print(__doc__)
        return 2 if unknown else 0
    if "--list" in options:
        print("\n".join(MUTANTS))
        return 0
    if "--identity" in options:
        return identity_check()
    return run_mutants(names or list(MUTANTS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
