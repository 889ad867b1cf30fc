"""Whether a bfloat16 dot pays on this CPU (``amp_jax.cpu_bf16_support``), and
what the CPU backend's plan does with the answer.

conftest.py pins the decision (``AMP_JAX_CPU_BF16=yes``) for the suite; these
tests unpin it and fake each answer of the flag reader and of the probe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, eqns

import amp_jax
from amp_jax import Policy, amp
from amp_jax._src import backends, compat
from amp_jax._src.backends import cpu_bf16

AVX2 = ("x86", frozenset({"fpu", "sse2", "avx", "avx2", "fma"}))
AVX512_BF16 = ("x86", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = ("x86", frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}))
ARM_NO_BF16 = ("aarch64", frozenset({"fp", "asimd", "sve"}))
ARM_BF16 = ("aarch64", frozenset({"fp", "asimd", "bf16", "i8mm"}))

SLOW = ((256, 2e-3, 1e-3), (512, 9e-3, 4e-3), (768, 30e-3, 14e-3))
FAST = ((256, 0.3e-3, 0.4e-3), (512, 1.3e-3, 2.5e-3), (768, 4.3e-3, 8.5e-3))


@pytest.fixture
def machine(monkeypatch):
    """Sets up a faked machine: ``machine(flags, timings=None, env="auto")``;
    returns the list of probe calls. The decision's cache is cleared before and
    after, so the suite's pinned answer comes back."""
    calls: list[int] = []

    def fake(flags, timings=None, env="auto"):
        monkeypatch.setenv(cpu_bf16.ENV, env)
        monkeypatch.setattr(cpu_bf16, "_READ_FLAGS", lambda: flags)

        def probe():
            calls.append(1)
            if timings is None:
                raise AssertionError("the probe ran where the flags decide")
            return timings

        monkeypatch.setattr(cpu_bf16, "_PROBE", probe)
        amp_jax.cpu_bf16_support.cache_clear()
        return calls

    amp_jax.cpu_bf16_support.cache_clear()
    yield fake
    amp_jax.cpu_bf16_support.cache_clear()


def _loss(x, w1, w2):
    return jnp.sum(jnp.tanh(x @ w1) @ w2)


def _args():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (
        jax.random.normal(k[0], (32, 128)),
        jax.random.normal(k[1], (128, 128)),
        jax.random.normal(k[2], (128, 64)),
    )


def _dot_dtypes(policy="bfloat16", backend=None):
    """The operand dtypes of every dot of ``grad(amp(_loss))`` planned for the
    CPU record now in force (or ``backend``)."""
    fn = jax.grad(amp(_loss, policy=policy), argnums=(1, 2))
    if backend is not None:
        with backends.use(backend):
            closed = jax.make_jaxpr(fn)(*_args())
    else:
        closed = jax.make_jaxpr(fn)(*_args())
    return {
        str(np.dtype(e.invars[0].aval.dtype))
        for e, _ in eqns(closed)
        if e.primitive.name == "dot_general"
    }


def _dot_reasons(policy="bfloat16"):
    rows = amp_jax.explain(_loss, *_args(), policy=policy, grad=True).rows
    return [r.reason for r in rows if r.primitive == "dot_general"]


@pytest.mark.parametrize(
    "flags, pays",
    [(AVX2, False), (AVX512_BF16, True), (AMX, True), (ARM_NO_BF16, False)],
    ids=["avx2", "avx512_bf16", "amx_bf16", "arm-no-bf16"],
)
def test_the_cpu_flags_decide_and_the_plan_follows(machine, flags, pays):
    machine(flags)
    support = amp_jax.cpu_bf16_support()
    assert (support.pays, support.source) == (pays, "flags")
    assert set(support.flags) == set(cpu_bf16.RELEVANT_FLAGS) & flags[1]
    assert backends.current().bf16_dots == support
    if pays:
        assert _dot_dtypes() == {"bfloat16"}
        assert not any("bfloat16 dot instructions" in r for r in _dot_reasons())
    else:
        # every dot, forward and backward, as float32 as without amp; explain says why
        assert _dot_dtypes() == {"float32"}
        reasons = _dot_reasons()
        assert len(reasons) >= 4, reasons
        assert all(cpu_bf16.NO_INSTRUCTIONS in r for r in reasons), reasons
        report = amp_jax.format_dtype_report(
            amp_jax.dtype_report(_loss, *_args(), policy="bfloat16", grad=True)
        )
        assert cpu_bf16.NO_INSTRUCTIONS in report


@pytest.mark.parametrize(
    "flags, timings, pays",
    [(None, SLOW, False), (None, FAST, True), (ARM_BF16, SLOW, False), (ARM_BF16, FAST, True)],
    ids=["no-flags-slow", "no-flags-fast", "arm-bf16-slow", "arm-bf16-fast"],
)
def test_where_the_flags_do_not_say_the_probe_decides(machine, flags, timings, pays):
    calls = machine(flags, timings)
    support = amp_jax.cpu_bf16_support()
    assert (support.pays, support.source, support.timings) == (pays, "probe", timings)
    assert "768: 30.00 ms bf16 / 14.00 ms f32" in support.evidence or pays
    assert _dot_dtypes() == ({"bfloat16"} if pays else {"float32"})
    if not pays:
        assert all("measured slower than float32" in r for r in _dot_reasons())
    assert len(calls) == 1


def test_the_decision_is_made_once_for_every_trace(machine):
    calls = machine(None, SLOW)
    for n in (16, 32, 48, 64):  # a new trace per shape
        x = jnp.ones((n, 128))
        jax.jit(jax.grad(amp(lambda x, w: jnp.sum(x @ w))))(x, jnp.ones((128, 64)))
        amp_jax.explain(lambda x, w: jnp.sum(x @ w), x, jnp.ones((128, 64)))
    assert len(calls) == 1
    assert amp_jax.cpu_bf16_support() is amp_jax.cpu_bf16_support()
    assert backends.current() is backends.current()


def test_backend_unaware_policies_lower_dots_on_every_cpu(machine):
    machine(AVX2)
    assert not amp_jax.cpu_bf16_support().pays
    assert _dot_dtypes(Policy(backend_aware=False)) == {"bfloat16"}
    # a user's override of the dot's class also wins
    assert _dot_dtypes(Policy(overrides={"dot_general": "allow"})) == {"bfloat16"}


def test_float16_policies_and_other_backends_are_not_touched(machine):
    machine(AVX2)
    assert _dot_dtypes(Policy(jnp.float16)) == {"float16"}
    gpu = backends.backend_for("gpu")
    assert gpu.bf16_dots is None and gpu.slower_low("dot_general", BF16) is None
    assert _dot_dtypes(backend=gpu) == {"bfloat16"}


@pytest.mark.parametrize("value, pays", [("yes", True), ("YES", True), (" no ", False)])
def test_the_environment_variable_overrides_the_flags(machine, value, pays):
    machine(AVX512_BF16 if not pays else AVX2, env=value)
    support = amp_jax.cpu_bf16_support()
    assert (support.pays, support.source) == (pays, "env")
    assert _dot_dtypes() == ({"bfloat16"} if pays else {"float32"})
    if not pays:
        assert all(f"{cpu_bf16.ENV}=no" in r for r in _dot_reasons())


def test_the_environment_variable_is_read_once(machine, monkeypatch):
    machine(AVX2, env="yes")
    assert amp_jax.cpu_bf16_support().pays
    monkeypatch.setenv(cpu_bf16.ENV, "no")
    assert amp_jax.cpu_bf16_support().pays  # (cached: the process's one decision)


def test_an_invalid_environment_variable_names_itself_and_its_values(machine):
    machine(AVX2, env="maybe")
    with pytest.raises(ValueError, match=r"AMP_JAX_CPU_BF16='maybe' is not one of auto, yes, no"):
        amp_jax.cpu_bf16_support()
    with pytest.raises(ValueError, match="AMP_JAX_CPU_BF16"):
        amp(_loss)(*_args())


def test_parse_cpuinfo_reads_x86_flags_and_arm_features():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n"
    assert cpu_bf16.parse_cpuinfo(x86) == ("x86", frozenset({"fpu", "avx2", "avx512_bf16"}))
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU part\t: 0xd40\n"
    assert cpu_bf16.parse_cpuinfo(arm) == ("aarch64", frozenset({"fp", "asimd", "bf16", "i8mm"}))
    assert cpu_bf16.parse_cpuinfo("processor\t: 0\n") is None


def test_the_probe_times_both_kernels_even_inside_a_trace():
    # (structure only: which one is faster depends on the machine)
    found = []

    @jax.jit
    def f(x):
        found.append(cpu_bf16.probe((64, 128)))
        return x

    f(jnp.ones(2))
    (timings,) = found
    assert [n for n, _, _ in timings] == [64, 128]
    assert all(isinstance(t, float) and 0 < t < 1 for _, b, f in timings for t in (b, f))


def _nested(x, w1, w2):
    """`_loss` through a jitted helper of its own, as a library writes it."""
    return jnp.sum(jax.jit(lambda h: jnp.tanh(h @ w1))(x) @ w2)


def _jits(closed):
    """The program's jit calls (not amp's own helpers, which JAX inlines: on
    JAX 0.12 they stay in the jaxpr, `Inline.JAX_LATE`)."""
    return sum(
        e.primitive.name in compat.JIT_NAMES and not compat.jit_inlined_by_jax(e)
        for e in closed.jaxpr.eqns
    )


def test_where_nothing_can_run_low_amp_keeps_the_programs_jits(machine):
    # (a CPU without bfloat16 dots: amp's program is float32's, the helper's jit
    # kept as a call, so that JAX differentiates and lowers it once, as fn's)
    machine(AVX2)
    args = _args()
    step = jax.value_and_grad(_nested, argnums=(1, 2))
    amp_step = jax.value_and_grad(amp(_nested), argnums=(1, 2))
    assert _jits(jax.make_jaxpr(amp(_nested))(*args)) == _jits(jax.make_jaxpr(_nested)(*args)) == 1
    want, got = jax.jit(step)(*args), jax.jit(amp_step)(*args)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), want, got))
    hlo = jax.jit(amp_step).lower(*args).compile().as_text()
    assert hlo.count(" convert(") == 0 and "bf16[" not in hlo
    assert all("no bfloat16 dot instructions" in r for r in _dot_reasons())


@pytest.mark.parametrize(
    "policy",
    [Policy(backend_aware=False), Policy(overrides={"dot_general": "allow"}), Policy(jnp.float16)],
    ids=["backend_unaware", "override", "float16"],
)
def test_where_an_op_can_run_low_amp_inlines_the_jits_to_plan_through_them(machine, policy):
    machine(AVX2)
    closed = jax.make_jaxpr(amp(_nested, policy=policy))(*_args())
    assert _jits(closed) == 0
    assert {
        str(np.dtype(e.invars[0].aval.dtype))
        for e, _ in eqns(closed)
        if e.primitive.name == "dot_general"
    } != {"float32"}


def test_inside_a_kept_jit_sensitive_ops_still_read_float32(machine):
    machine(AVX2)
    x = jnp.ones((4, 8), BF16)
    closed = jax.make_jaxpr(amp(lambda v: jax.jit(jax.nn.softmax)(v) * 2))(x)
    assert _jits(closed) == 1
    exps = [e for e, _ in eqns(closed) if e.primitive.name == "exp"]
    assert exps and all(e.invars[0].aval.dtype == jnp.float32 for e in exps)
    machine(AVX512_BF16)  # (a CPU with bfloat16 dots: jits inlined, as before)
    assert _jits(jax.make_jaxpr(amp(_nested))(*_args())) == 0
