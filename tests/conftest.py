"""Test configuration: 8 simulated CPU devices, strict rank promotion, exact matmuls.

XLA_FLAGS must be set before JAX initialises its backend, so it is done here at import
time (conftest is the test entry point; the library itself never sets env vars).
"""
import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Hermetic: no test reads or fills the user's compilation cache (test_compile_cache.py
# turns it on explicitly, in its own processes).
os.environ.setdefault("JAXRL_AGENT_COMPILE_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
