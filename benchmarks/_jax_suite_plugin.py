"""pytest plugin of `benchmarks/jax_suite.py`: JAX's own tests with amp wrapped in.

Loaded with ``-p benchmarks._jax_suite_plugin`` into a pytest run of JAX's test
files. ``AMP_JAX_SUITE_MODE`` picks what it does:

- ``off``: nothing is wrapped (the baseline run);
- ``float32``: amp's interpreter forced on at float32
  (`amp_jax._src.testing.interpreted_float32`: every equation re-bound, no
  dtype changed);
- ``bfloat16``: ``amp(fn, policy="bfloat16")``;
- ``jit``: the control: ``jax.jit(fn)`` where amp would be. A test that fails
  here too fails because its function is traced to a jaxpr (a Python ``if`` on
  a traced value, a count of JAX's caches, a leaked tracer), as it is by amp.

``AMP_JAX_SUITE_SUITE`` names the library whose tests run (``jax``,
``equinox`` or ``flax_nnx``; a comma-separated list for the smoke run):
`TARGETS` lists, per suite, the transformations whose function argument is
wrapped. In every suite ``jax.jit``, ``jax.grad``, ``jax.value_and_grad``,
``jax.vmap``, ``jax.jvp``, ``jax.vjp``, ``jax.linearize``, ``jax.jacfwd``,
``jax.jacrev`` and ``jax.hessian`` (and their originals in ``jax._src.api``,
which JAX's tests call as ``api.jit``); in ``equinox`` also
``eqx.filter_jit``, ``filter_grad``, ``filter_value_and_grad`` and
``filter_vmap``; in ``flax_nnx`` also ``nnx.jit``, ``nnx.grad``,
``nnx.value_and_grad`` and ``nnx.vmap``. In the two amp modes they are
replaced by functions that wrap the function argument in amp and call the
original; in ``jit`` mode the control is the suite's own jit (`CONTROL`:
``jax.jit``, ``eqx.filter_jit``, ``nnx.jit``), since a plain ``jax.jit``
refuses the modules and functions the libraries' tests pass. Only calls made
from a test file are wrapped (the caller's file is under the directory of the
files collected): the libraries' own code calls these transformations too,
and what is under test is amp around the tests' functions. A function already
under amp (one of these wrappers' results, or amp itself, found through
``__wrapped__``) is not wrapped again, unless ``AMP_JAX_SUITE_NESTED=1``.
Calls from JAX's test helpers (``jax._src.test_util``'s ``_CompileAndCheck``,
``public_test_util``'s ``check_grads``) count as the test file's, unless
``AMP_JAX_SUITE_HELPERS=0``.

Every test's outcome goes as one JSON line to ``AMP_JAX_SUITE_LOG``: node id,
outcome, ``crash`` (the exception is not an ``AssertionError``), the
exception's type and first line, and how many functions were wrapped.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

MODE = os.environ.get("AMP_JAX_SUITE_MODE", "off")
SUITE = os.environ.get("AMP_JAX_SUITE_SUITE", "jax")
NESTED = os.environ.get("AMP_JAX_SUITE_NESTED", "0") == "1"
HELPERS = os.environ.get("AMP_JAX_SUITE_HELPERS", "1") == "1"
LOG = os.environ.get("AMP_JAX_SUITE_LOG")

#: JAX's transformations whose function argument is wrapped
NAMES = (
    "jit",
    "grad",
    "value_and_grad",
    "vmap",
    "jvp",
    "vjp",
    "linearize",
    "jacfwd",
    "jacrev",
    "hessian",
)

#: per suite, (module, names) of the transformations wrapped; JAX's in every
#: suite, where the test files find them: ``jax.jit`` and, in JAX's own tests,
#: ``jax._src.api.jit`` (``from jax._src import api``; ``api.jit(f)``)
TARGETS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "jax": (("jax", NAMES), ("jax._src.api", NAMES)),
    "equinox": (
        ("equinox", ("filter_jit", "filter_grad", "filter_value_and_grad", "filter_vmap")),
    ),
    "flax_nnx": (("flax.nnx", ("jit", "grad", "value_and_grad", "vmap")),),
}
#: the control of ``jit`` mode: the suite's own jit, which takes what its tests pass
CONTROL = {
    "jax": ("jax", "jit"),
    "equinox": ("equinox", "filter_jit"),
    "flax_nnx": ("flax.nnx", "jit"),
}
#: transformations that return values, not a function to mark as already wrapped
NOT_FUNCTIONS = ("jvp", "vjp", "linearize")

_test_dirs: tuple[str, ...] = ()
_wrapped = 0
#: what this plugin made (a marker attribute where the object takes one, else its id)
_made: dict[int, Any] = {}


def suites(spec: str = SUITE) -> list[str]:
    """The suites of ``spec`` (``AMP_JAX_SUITE_SUITE``), JAX's first."""
    names = [s for s in spec.split(",") if s]
    unknown = [s for s in names if s not in TARGETS]
    if unknown:
        raise ValueError(f"AMP_JAX_SUITE_SUITE={spec!r}: use {', '.join(TARGETS)}")
    return ["jax", *(s for s in names if s != "jax")]


def originals(spec: str = SUITE) -> dict[tuple[str, str], Any]:
    """The unpatched transformation at each (module, name) of ``spec``'s suites."""
    out = {}
    for suite in suites(spec):
        for module_name, names in TARGETS[suite]:
            module = importlib.import_module(module_name)
            for name in names:
                fn = getattr(module, name)
                out[(module_name, name)] = getattr(fn, "_amp_jax_suite_original", fn)
    return out


def _mark(fn: Any) -> Any:
    try:
        fn._amp_jax_suite = True
    except (AttributeError, TypeError):  # an Equinox Module is frozen
        _made[id(fn)] = fn
    return fn


def _under_amp(fn: Any) -> bool:
    from amp_jax._src.transform import AmpFunction

    seen = 0
    while fn is not None and seen < 20:
        if isinstance(fn, AmpFunction) or getattr(fn, "_amp_jax_suite", False):
            return True
        if _made.get(id(fn)) is fn:
            return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def _control(fn: Any) -> Any:
    module_name, name = CONTROL[suites()[-1]]
    return _mark(originals()[(module_name, name)](fn))


def _wrap(fn: Any) -> Any:
    """``fn`` under amp in this run's mode (as it is if it is not a function
    or is already under amp)."""
    global _wrapped
    if not callable(fn) or (not NESTED and _under_amp(fn)):
        return fn
    if MODE == "float32":
        from amp_jax._src.testing import interpreted_float32

        out = interpreted_float32(fn)
    elif MODE == "jit":
        out = _control(fn)
    else:
        import amp_jax

        out = amp_jax.amp(fn, policy=MODE)
    _wrapped += 1
    return out


def _from_test(depth: int = 2) -> bool:
    filename = sys._getframe(depth).f_code.co_filename
    return any(filename.startswith(d) for d in _test_dirs)


def _patched(name: str, original: Any) -> Any:
    """``original`` (the transformation ``name``) with its function argument
    (the first positional one, or ``fun=``/``f=``) wrapped by `_wrap` when a
    test file calls it."""

    @functools.wraps(original)
    def transform(*args: Any, **kwargs: Any) -> Any:
        if not _from_test():
            return original(*args, **kwargs)
        if args:
            args = (_wrap(args[0]), *args[1:])
        elif "fun" in kwargs or "f" in kwargs:
            key = "fun" if "fun" in kwargs else "f"
            kwargs[key] = _wrap(kwargs[key])
        else:  # jax.jit(static_argnums=...), eqx.filter_jit(donate=...) as a decorator factory
            return functools.partial(transform, **kwargs)
        out = original(*args, **kwargs)
        return _mark(out) if callable(out) and name not in NOT_FUNCTIONS else out

    transform._amp_jax_suite_original = original
    return transform


def patch(spec: str = SUITE) -> dict[tuple[str, str], Any]:
    """Replace the transformations of ``spec``'s suites by `_patched` ones
    (one per original: ``jax.jit`` and ``jax._src.api.jit`` share theirs);
    what was replaced, to undo it with `unpatch`."""
    found = originals(spec)
    patched: dict[int, Any] = {}
    done = {}
    for (module_name, name), original in found.items():
        module = importlib.import_module(module_name)
        if getattr(module, name) is original:
            new = patched.setdefault(id(original), _patched(name, original))
            setattr(module, name, new)
            done[(module_name, name)] = original
    return done


def unpatch(done: dict[tuple[str, str], Any]) -> None:
    """Undo `patch`."""
    for (module_name, name), original in done.items():
        setattr(importlib.import_module(module_name), name, original)


def pytest_configure(config: Any) -> None:
    global _test_dirs
    dirs = {os.path.dirname(os.path.abspath(str(a).split("::")[0])) + os.sep for a in config.args}
    if HELPERS:
        # JAX's test helpers jit and differentiate the function a test hands them
        # (_CompileAndCheck, check_grads): calls from them are the tests' calls too.
        # Their file is found without importing them: test_util binds sys.stdout
        # at import (capture_stdout), and imported here, before pytest's capture,
        # its capture_stdout would read the wrong stream
        for name in ("jax._src.test_util", "jax._src.public_test_util"):
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.origin is not None, name
            dirs.add(spec.origin)
    _test_dirs = tuple(sorted(dirs))
    suites()  # an unknown suite fails here, in every mode
    if MODE == "off":
        return
    if MODE not in ("float32", "bfloat16", "jit"):
        raise ValueError(f"AMP_JAX_SUITE_MODE={MODE!r}: use off, float32, bfloat16 or jit")
    patch()


def pytest_runtest_setup(item: Any) -> None:
    global _wrapped
    _wrapped = 0


_failures: dict[tuple[str, str], tuple[str, str]] = {}


def pytest_runtest_makereport(item: Any, call: Any) -> None:
    exc = call.excinfo
    if exc is not None:
        kind = "AssertionError" if isinstance(exc.value, AssertionError) else exc.type.__name__
        text = str(exc.value).strip().splitlines()
        _failures[(item.nodeid, call.when)] = (kind, text[0][:300] if text else "")


def pytest_runtest_logreport(report: Any) -> None:
    if not LOG or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    kind, message = _failures.pop((report.nodeid, report.when), ("", ""))
    row = {
        "nodeid": report.nodeid,
        "outcome": report.outcome,
        "when": report.when,
        "crash": (kind != "AssertionError") if report.failed else None,
        "type": kind if report.failed else "",
        "message": message if report.failed else "",
        "wrapped": _wrapped,
    }
    with open(LOG, "a") as f:
        f.write(json.dumps(row) + "\n")
