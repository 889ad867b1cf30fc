import os
import pathlib
import sys

import pytest

# the suite's helpers (_util.py) beside this file; the scripts the suite loads as
# plugins (tools/mutants.py, tools/resume.py) in tools/. Test files live in
# tests/ (one per module of amp_jax), tests/behaviour/ (behaviours across modules and
# libraries) and tests/repository/ (the repository: docs, packaging, style, layering).
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE), str(_HERE.parent / "tools")) if p not in sys.path]

# Multi-device tests (shard_map) use forced host devices; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# amp's CPU backend lowers dots to bfloat16 only where the CPU runs them fast
# (amp_jax.cpu_bf16_support: avx512_bf16/amx_bf16 flags or a probe). The suite
# asserts bf16 dots on CPU: pin the decision so that results do not depend on the
# CI machine's CPU (tests/test_cpu_bf16.py fakes every answer).
os.environ["AMP_JAX_CPU_BF16"] = "yes"

# tools/mutants.py: run the suite against a named mutant (a feature replaced by a no-op).
if os.environ.get("AMP_JAX_MUTANT"):
    import mutants

    mutants.apply(os.environ["AMP_JAX_MUTANT"])

# tools/resume.py: record the tests run, and deselect those an earlier, cut-off run reached.
if os.environ.get("AMP_JAX_RESUME"):
    from resume import (  # noqa: F401
        pytest_collection_modifyitems,
        pytest_configure,
        pytest_runtest_logreport,
    )


@pytest.fixture
def low_elementwise():
    """Plans as a GPU or TPU does, on this CPU: ``follow`` ops between two low
    ops painted in the compute dtype (XLA:CPU's record keeps them float32,
    tests/behaviour/test_cpu_elementwise.py). For tests of the painting itself."""
    from _util import low_elementwise as block

    with block() as record:
        yield record
