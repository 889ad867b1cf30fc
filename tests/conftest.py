import os

# Multi-device tests (shard_map) use forced host devices; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
