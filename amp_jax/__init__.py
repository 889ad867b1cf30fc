"""amp_jax: automatic mixed precision for JAX."""
