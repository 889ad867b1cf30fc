"""The amp_jax demo (``python -m amp_jax.demo``)."""
