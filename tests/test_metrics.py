"""loops/metrics.py: the compile-time counter the RL loop logs as time/compile."""
import jax
import jax.numpy as jnp

from jaxrl_agent.loops.metrics import compile_seconds, watch_compiles


def test_compile_seconds_counts_a_new_programs_trace_and_compile():
    watch_compiles()
    watch_compiles()  # idempotent: one listener, so nothing is counted twice
    before = compile_seconds()
    f = jax.jit(lambda x: jnp.cumsum(jnp.sin(x) * 3.0))  # a new function: traced, lowered, compiled
    f(jnp.arange(37.0)).block_until_ready()
    after = compile_seconds()
    assert after > before
    f(jnp.arange(37.0)).block_until_ready()  # the same shapes again: nothing compiles
    assert compile_seconds() == after
