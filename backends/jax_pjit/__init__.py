"""JAX backend: flax model, mesh + logical-axis rules, jitted steps, optax, orbax."""
