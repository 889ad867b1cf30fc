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

In the two amp modes, ``jax.jit``, ``jax.grad``, ``jax.value_and_grad``,
``jax.vmap``, ``jax.jvp``, ``jax.vjp``, ``jax.linearize``, ``jax.jacfwd``,
``jax.jacrev`` and ``jax.hessian`` (and their originals in ``jax._src.api``,
which JAX's tests call as ``api.jit``) are replaced by functions that wrap the
function argument in amp and call the original. Only calls made from a test
file are wrapped (the caller's file is under the directory of the files
collected): JAX's own library code calls ``jax.jit`` too, and what is under
test is amp around the tests' functions. A function already under amp (one of
these wrappers' results, or amp itself, found through ``__wrapped__``) is not
wrapped again, unless ``AMP_JAX_SUITE_NESTED=1``. Calls from JAX's test helpers
(``jax._src.test_util``'s ``_CompileAndCheck``, ``public_test_util``'s
``check_grads``) count as the test file's, unless ``AMP_JAX_SUITE_HELPERS=0``.

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

import jax

MODE = os.environ.get("AMP_JAX_SUITE_MODE", "off")
NESTED = os.environ.get("AMP_JAX_SUITE_NESTED", "0") == "1"
HELPERS = os.environ.get("AMP_JAX_SUITE_HELPERS", "1") == "1"
LOG = os.environ.get("AMP_JAX_SUITE_LOG")

#: the transformations whose function argument is wrapped
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

#: where the test files find them: ``jax.jit`` and, in JAX's own tests,
#: ``jax._src.api.jit`` (``from jax._src import api``; ``api.jit(f)``)
MODULES = ("jax", "jax._src.api")
ORIGINAL = {name: getattr(jax, name) for name in NAMES}
_test_dirs: tuple[str, ...] = ()
_wrapped = 0


def _under_amp(fn: Any) -> bool:
    from amp_jax._src.transform import AmpFunction

    seen = 0
    while fn is not None and seen < 20:
        if isinstance(fn, AmpFunction) or getattr(fn, "_amp_jax_suite", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


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
        out = ORIGINAL["jit"](fn)
        try:
            out._amp_jax_suite = True
        except (AttributeError, TypeError):
            pass
    else:
        import amp_jax

        out = amp_jax.amp(fn, policy=MODE)
    _wrapped += 1
    return out


def _from_test(depth: int = 2) -> bool:
    filename = sys._getframe(depth).f_code.co_filename
    return any(filename.startswith(d) for d in _test_dirs)


def _patched(name: str) -> Any:
    original = ORIGINAL[name]

    @functools.wraps(original)
    def transform(*args: Any, **kwargs: Any) -> Any:
        if not _from_test():
            return original(*args, **kwargs)
        if args:
            args = (_wrap(args[0]), *args[1:])
        elif "fun" in kwargs:
            kwargs["fun"] = _wrap(kwargs["fun"])
        else:  # jax.jit(static_argnums=...) as a decorator factory
            return functools.partial(transform, **kwargs)
        out = original(*args, **kwargs)
        if callable(out) and name not in ("jvp", "vjp", "linearize"):
            try:
                out._amp_jax_suite = True
            except (AttributeError, TypeError):
                pass
        return out

    transform._amp_jax_suite_original = original
    return transform


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
    if MODE == "off":
        return
    if MODE not in ("float32", "bfloat16", "jit"):
        raise ValueError(f"AMP_JAX_SUITE_MODE={MODE!r}: use off, float32, bfloat16 or jit")
    patched = {name: _patched(name) for name in NAMES}
    for module in map(importlib.import_module, MODULES):
        for name in NAMES:
            if getattr(module, name, None) is ORIGINAL[name]:
                setattr(module, name, patched[name])


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
