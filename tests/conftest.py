import os

# Multi-device tests (shard_map) use forced host devices; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# tests/mutants.py: run the suite against a named mutant (a feature replaced by a no-op).
if os.environ.get("AMP_JAX_MUTANT"):
    import mutants

    mutants.apply(os.environ["AMP_JAX_MUTANT"])
