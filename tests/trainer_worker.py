"""Shared builders for the trainer tests, and the worker process that test_distributed.py
launches (`python tests/trainer_worker.py OUT.npz`, environment from the test).

The worker joins a `jax.distributed` job through `sharding.initialize_distributed()` (the
launcher's JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID), builds the same
tiny model and batch as the single-process reference, runs `STEPS` train steps on a mesh over
every process's devices, and process 0 writes the resulting parameters and metrics.
"""
from __future__ import annotations

import sys

import numpy as np

from jaxrl_agent.model.decoder import CausalLM, ModelConfig

STEPS = 2
# Unoptimised XLA codegen: half the compile time, and at these sizes the same run time.
FAST = (("xla_backend_optimization_level", 0),)


def tiny_config(**overrides):
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, rope_theta=1000.0, qkv_bias=True, architecture="Qwen2ForCausalLM")
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides):
    """A tiny CausalLM with NumPy-drawn weights (no per-shape eager compiles): matrices
    normal(0.02), biases normal(0.02), norms 1 + normal(0.1), value head 0, so every
    parameter gets a gradient."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.eval_shape(lambda: CausalLM(tiny_config(**overrides), rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for (name,), var in sorted(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        if name.startswith("value_"):
            value = np.zeros(var.shape)
        elif name.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(var.shape)
        else:
            value = 0.02 * rng.standard_normal(var.shape)
        getattr(model, name).set_value(jnp.asarray(value, jnp.float32))
    return model


def random_episodes(n: int, seed: int = 0, *, vocab: int = 128, group_size: int = 4, min_len: int = 8,
                    max_len: int = 30):
    """Multi-turn episodes: prompt (mask 0), response (mask 1), observation (mask 0), response.
    Rewards 0 / 1 vary inside each group so group advantages are non-zero."""
    from jaxrl_agent.trajectory import Episode

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        p, o = int(rng.integers(2, 5)), int(rng.integers(1, 3))
        r1 = max(1, (length - p - o) // 2)
        r2 = max(1, length - p - r1 - o)
        length = p + r1 + o + r2
        mask = [0] * p + [1] * r1 + [0] * o + [1] * r2
        turn = [0] * (p + r1) + [1] * (o + r2)
        logp = [float(-rng.random() * 3) if m else 0.0 for m in mask]
        reward = float((i + seed) % 3 == 0) if i % group_size else float(i % 2)
        out.append(Episode(list(map(int, rng.integers(0, vocab, length))), mask, logp, turn, reward, i // group_size))
    return out


def main(out_path: str) -> None:
    from jaxrl_agent.train import sharding as sh

    sh.initialize_distributed()  # before anything touches the backend
    import jax

    from jaxrl_agent.config import MeshConfig, TrajectoryConfig
    from jaxrl_agent.losses.registry import LOSSES
    from jaxrl_agent.train.step import make_train_step
    from jaxrl_agent.trajectory import collate

    cfg = distributed_train_config(MeshConfig(data=2, fsdp=2, preset="fsdp"))
    model = tiny_model()
    ts = make_train_step(LOSSES["grpo"], distributed_optimizer(), cfg, model)
    state = ts.init_state(model, seed=0)
    batch, _ = collate(random_episodes(8, seed=3), TrajectoryConfig(buckets=(32,), batch_multiple=4))
    metrics = []
    for _ in range(STEPS):
        state, m = ts(state, batch)
        metrics.append(float(m["loss"].addressable_data(0)))  # replicated: every process has it
    params = jax.jit(ts.policy_params, out_shardings=ts.replicated)(state)
    if jax.process_index() == 0:
        flat = {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}
        np.savez(out_path, loss=np.asarray(metrics), devices=jax.device_count(), processes=jax.process_count(), **flat)


def distributed_optimizer():
    """Clipped SGD with momentum: linear in the gradients, so float summation-order noise in
    near-zero gradients is not amplified the way Adam's g / sqrt(v) amplifies it."""
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(10.0, momentum=0.9))


def distributed_train_config(mesh_cfg):
    from jaxrl_agent.config import LossConfig, TrainConfig

    return TrainConfig(compiler_options=FAST, loss=LossConfig(agg="seq-mean-token-mean", kl_coef=0.05),
                       mesh=mesh_cfg, use_ref=True,
                       old_logp="recompute")


if __name__ == "__main__":
    main(sys.argv[1])
