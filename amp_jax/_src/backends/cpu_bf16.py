"""Whether a bfloat16 dot pays on the CPU this process runs on.

XLA:CPU runs amp's lowered dots (bfloat16 operands, float32 accumulation) in a
fast kernel only where the CPU has bfloat16 dot instructions (x86: AVX512-BF16
or AMX-BF16): there a training step takes 0.34x-0.60x float32's time. Elsewhere
(AVX2-only x86: AMD EPYC without AVX512-BF16, older Intel Xeons) the same dots
run slower than in float32 and amp made models 1.05x-1.28x slower (issue 57).
So amp decides once per process (`cpu_bf16_support`, cached) and, where a
bfloat16 dot does not pay, keeps the dots of a bfloat16 policy in float32 on
the CPU backend (``Policy(backend_aware=True)``, the default).

How it decides, first answer wins:

1. the environment variable ``AMP_JAX_CPU_BF16`` (read once): ``yes`` or ``no``
   pins the answer (what CI and tests do); ``auto`` (or unset) decides below;
2. x86 with the flags in Linux's ``/proc/cpuinfo``: ``avx512_bf16`` or
   ``amx_bf16`` pays, neither does not;
3. aarch64 without the ``bf16`` feature (``/proc/cpuinfo``'s ``Features``,
   macOS's ``sysctl hw.optional.arm.FEAT_BF16``) does not pay;
4. elsewhere (an aarch64 CPU with ``bf16``, whose use by XLA:CPU we have not
   measured; an OS that does not say) a short probe: XLA's bf16 x bf16 -> f32
   and f32 dots timed at a few sizes (under a second), recorded in the answer;
   it pays where bfloat16 is 15% faster at most of the sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

#: the environment variable that pins the decision, and the values it takes
ENV = "AMP_JAX_CPU_BF16"
CHOICES = ("auto", "yes", "no")

#: the CPU flags that bear on bfloat16 dots, recorded where the OS reports them
#: (x86: ``avx512_bf16``, ``amx_bf16``; aarch64: ``bf16``, ``i8mm``)
RELEVANT_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2", "bf16", "i8mm")
_X86_BF16 = ("avx512_bf16", "amx_bf16")

#: the probe's dot sizes (n x n times n x n), the runs of each kernel per size,
#: and how much faster than float32 a bfloat16 dot must be, at most of the
#: sizes, to pay for amp's casts
PROBE_SIZES = (256, 512, 768)
PROBE_RUNS = 5
PROBE_MARGIN = 0.85

NO_INSTRUCTIONS = "this CPU has no bfloat16 dot instructions: float32 is faster"


@dataclasses.dataclass(frozen=True)
class CpuBf16Support:
    """Whether a bfloat16 dot pays on this CPU, and the evidence (`cpu_bf16_support`).

    Attributes:
      pays: True where amp lowers the dots of a bfloat16 policy on the CPU
        backend; False where they stay float32 (``Policy(backend_aware=True)``).
      source: how it was decided: ``"env"`` (``AMP_JAX_CPU_BF16=yes|no``),
        ``"flags"`` (the CPU flags the OS reports) or ``"probe"`` (timed).
      evidence: what it was decided from, in words.
      flags: the CPU's flags among `RELEVANT_FLAGS` (e.g. ``("avx2",
        "avx512_bf16", "avx512f")``); empty where the OS does not report them.
      timings: the probe's ``(n, bfloat16 seconds, float32 seconds)`` per
        ``n x n x n`` dot; empty where no probe ran.
    """

    pays: bool
    source: str
    evidence: str
    flags: tuple[str, ...] = ()
    timings: tuple[tuple[int, float, float], ...] = ()

    @property
    def reason(self) -> str:
        """Why dots stay float32 here, as ``explain`` prints it ('' where they don't)."""
        if self.pays:
            return ""
        if self.source == "flags":
            return f"{NO_INSTRUCTIONS} ({self.evidence})"
        if self.source == "probe":
            return f"a bfloat16 dot measured slower than float32 on this CPU ({self.evidence})"
        return f"{ENV}=no: bfloat16 dots are off on this CPU"


def env_choice() -> str:
    """``AMP_JAX_CPU_BF16`` (lower case, ``auto`` where unset or empty); a
    ValueError naming the variable and its values for anything else."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV}={raw!r} is not one of {', '.join(CHOICES)}: 'yes' lowers dots to bfloat16 "
            "on this CPU, 'no' keeps them float32, 'auto' (the default) decides from the CPU's "
            "flags (or a short probe). Set it to one of these, or unset it."
        )
    return value


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]] | None:
    """``("x86", flags)`` or ``("aarch64", features)`` from the text of Linux's
    ``/proc/cpuinfo`` (its first ``flags`` or ``Features`` line), or None."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags":
            return "x86", frozenset(value.split())
        if key == "Features":
            return "aarch64", frozenset(value.split())
    return None


def read_flags() -> tuple[str, frozenset[str]] | None:
    """The CPU's architecture and flags as the OS reports them, or None where it
    does not (Linux: ``/proc/cpuinfo``; macOS on arm64: ``sysctl
    hw.optional.arm.FEAT_BF16``, as the feature ``bf16``)."""
    if sys.platform.startswith("linux"):
        try:
            return parse_cpuinfo(pathlib.Path("/proc/cpuinfo").read_text())
        except OSError:
            return None
    if sys.platform == "darwin" and platform.machine() == "arm64":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        if out not in ("0", "1"):
            return None
        return "aarch64", frozenset({"bf16"} if out == "1" else ())
    return None


def probe(sizes: tuple[int, ...] = PROBE_SIZES) -> tuple[tuple[int, float, float], ...]:
    """``(n, bfloat16 seconds, float32 seconds)`` per size: the best of
    `PROBE_RUNS` runs of XLA:CPU's ``n x n`` by ``n x n`` dot with bfloat16 operands and float32
    accumulation (the dot amp lowers to), and with float32 operands.

    Compiled ahead of time and run at compile-time evaluation
    (``jax.ensure_compile_time_eval``), so that it runs, rather than being
    staged, when the first decision is made inside a trace.
    """
    import jax

    with jax.ensure_compile_time_eval():
        return tuple(_timed(n, jax.devices("cpu")[0]) for n in sizes)


def _timed(n: int, device: object) -> tuple[int, float, float]:
    """``(n, bfloat16 seconds, float32 seconds)`` of one size (`probe`): the
    best of `PROBE_RUNS` runs of each, the two kernels taking turns (a
    machine busy for a moment slows both)."""
    import jax
    from jax import lax

    runs = []
    for dtype in (jax.numpy.bfloat16, np.float32):
        x = jax.device_put(np.ones((n, n), dtype), device)
        step = jax.jit(lambda a, b: lax.dot(a, b, preferred_element_type=np.float32))
        compiled = step.lower(x, x).compile()
        compiled(x, x).block_until_ready()
        runs.append((compiled, x))
    best = [float("inf"), float("inf")]
    for _ in range(PROBE_RUNS):
        for k, (compiled, x) in enumerate(runs):
            t0 = time.perf_counter()
            compiled(x, x).block_until_ready()
            best[k] = min(best[k], time.perf_counter() - t0)
    return n, best[0], best[1]


def _probed(flags: tuple[str, ...], why: str) -> CpuBf16Support:
    timings = _PROBE()
    faster = sum(b < PROBE_MARGIN * f for _, b, f in timings)
    pays = 2 * faster > len(timings)
    sizes = ", ".join(f"{n}: {1e3 * b:.2f} ms bf16 / {1e3 * f:.2f} ms f32" for n, b, f in timings)
    verdict = "pays" if pays else "does not pay"
    evidence = f"{why}; probe of XLA:CPU's dots, {sizes}: bfloat16 {verdict}"
    return CpuBf16Support(pays, "probe", evidence, flags, timings)


def decide() -> CpuBf16Support:
    """The decision, made now (`cpu_bf16_support` caches it)."""
    choice = env_choice()
    found = _READ_FLAGS()
    arch, flags = found if found is not None else ("", frozenset[str]())
    relevant = tuple(f for f in RELEVANT_FLAGS if f in flags)
    if choice != "auto":
        return CpuBf16Support(choice == "yes", "env", f"{ENV}={choice}", relevant)
    if arch == "x86":
        have = [f for f in _X86_BF16 if f in flags]
        if have:
            return CpuBf16Support(True, "flags", "cpu flags: " + ", ".join(have), relevant)
        return CpuBf16Support(False, "flags", "cpu flags: no avx512_bf16 or amx_bf16", relevant)
    if arch == "aarch64" and "bf16" not in flags:
        return CpuBf16Support(False, "flags", "cpu features: no bf16", relevant)
    why = "cpu features: bf16" if arch == "aarch64" else "the OS reports no CPU flags"
    return _probed(relevant, why)


#: the flag reader and the probe `decide` calls (tests replace them)
_READ_FLAGS: Callable[[], tuple[str, frozenset[str]] | None] = read_flags
_PROBE: Callable[[], tuple[tuple[int, float, float], ...]] = probe


@functools.cache
def cpu_bf16_support() -> CpuBf16Support:
    """Whether a bfloat16 dot pays on this CPU, decided once per process, and why.

    amp's CPU backend lowers the dots of a bfloat16 policy only where it pays;
    elsewhere they stay float32 (``explain`` says: "this CPU has no bfloat16
    dot instructions: float32 is faster") and ``amp`` costs no speed.
    ``Policy(backend_aware=False)`` lowers them regardless (bfloat16 numerics).

    The decision, first answer wins: the environment variable
    ``AMP_JAX_CPU_BF16`` (``yes``, ``no``, or ``auto``, the default), read once;
    the CPU flags the OS reports (x86: ``avx512_bf16`` or ``amx_bf16`` pays,
    neither does not; aarch64 without ``bf16`` does not); else a probe timing
    XLA:CPU's bfloat16 and float32 dots at a few sizes (under a second).

    Returns:
      A `CpuBf16Support`: ``pays``, ``source`` (``"env"``, ``"flags"`` or
      ``"probe"``), ``evidence``, the CPU's ``flags`` and the probe's ``timings``.

    Raises:
      ValueError: ``AMP_JAX_CPU_BF16`` holds another value.

    Examples:
      >>> import amp_jax
      >>> support = amp_jax.cpu_bf16_support()
      >>> support.source in ("env", "flags", "probe")
      True
    """
    return decide()
