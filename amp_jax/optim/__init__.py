"""Optax gradient transformations for low-precision training (filled in by the optim work)."""
__all__: list[str] = []
