"""HOST: a multi-step tool-choice bandit trained through the real loss registry.

The smallest setting that still has the shape of agent RL: an episode alternates observation
tokens (rendered by the "environment", loss_mask 0) and action tokens (sampled by the policy,
loss_mask 1); the reward is an outcome (1 only if every chosen tool is right) placed on the
last policy token; G episodes per task form a group. The policy is a softmax table
theta[task, step, tool], so a run takes seconds on CPU and the update direction of any
registered `LossFn` can be checked by whether success rises.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_agent.config import LossConfig
from jaxrl_agent.losses.registry import LOSSES, RL_LOSSES
from jaxrl_agent.structs import PolicyOutputs, TrainBatch


@dataclass(frozen=True)
class BanditConfig:
    """The tool-choice bandit (`train_bandit`)."""

    algo: str = "grpo"
    """Registered loss name (jaxrl_agent.losses.LOSSES)."""
    contexts: int = 8
    """Number of distinct task types (each has its own correct tool sequence)."""
    tools: int = 4
    """Number of tools to choose from at each decision."""
    steps: int = 2
    """Decisions per episode; reward 1 only if all are right."""
    group_size: int = 16
    """Episodes sampled per task (the GRPO group)."""
    tasks_per_iter: int = 4
    """Tasks (groups) per iteration."""
    iterations: int = 60
    """Policy updates."""
    lr: float = 0.1
    """Adam learning rate."""
    seed: int = 0
    """PRNG seed (tasks, sampling)."""


def _layout(steps: int, tools: int):
    """Token layout of one episode: [obs_0, act_0, obs_1, act_1, ...]; obs ids follow the tools."""
    T = 2 * steps
    act_pos = np.arange(1, T, 2)
    loss_mask = np.zeros(T, np.float32)
    loss_mask[act_pos] = 1.0
    obs_ids = tools + np.arange(steps)
    return T, act_pos, loss_mask, obs_ids


def policy_outputs(theta: jax.Array, task: jax.Array, tokens: jax.Array, act_pos: np.ndarray) -> PolicyOutputs:
    """logp / entropy [N, T] of `tokens` under the table policy; observation slots get 0
    (the environment, not the policy, produced them)."""
    logits = theta[task]  # [N, steps, tools]
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    acts = tokens[:, act_pos]  # [N, steps]
    logp_act = jnp.take_along_axis(logp_all, acts[..., None], axis=-1)[..., 0]
    ent = -(jnp.exp(logp_all) * logp_all).sum(-1)
    N, T = tokens.shape
    logp = jnp.zeros((N, T), logits.dtype).at[:, act_pos].set(logp_act)
    entropy = jnp.zeros((N, T), logits.dtype).at[:, act_pos].set(ent)
    return PolicyOutputs(logp=logp, entropy=entropy)


def train_bandit(cfg: BanditConfig, loss_cfg: LossConfig, *, verbose: bool = True) -> dict:
    """Train the table policy with `LOSSES[cfg.algo]`; returns success before/after and the
    per-iteration success curve."""
    if cfg.algo not in RL_LOSSES:
        raise ValueError(f"bandit.algo must be an RL loss in {RL_LOSSES}, got {cfg.algo!r}")
    if cfg.tools < 2 or cfg.steps < 1 or cfg.group_size < 2 or cfg.contexts < 1:
        raise ValueError("bandit needs tools >= 2, steps >= 1, group_size >= 2, contexts >= 1")
    loss_fn = LOSSES[cfg.algo]
    T, act_pos, loss_mask_row, obs_ids = _layout(cfg.steps, cfg.tools)
    rng = np.random.default_rng(cfg.seed)
    correct = rng.integers(0, cfg.tools, size=(cfg.contexts, cfg.steps))  # the hidden answer
    theta = jnp.zeros((cfg.contexts, cfg.steps, cfg.tools), jnp.float32)
    theta_ref = theta
    opt = optax.adam(cfg.lr)
    opt_state = opt.init(theta)

    @jax.jit
    def sample(theta, task, key):  # -> actions [N, steps], logp [N, steps]
        logits = theta[task]
        acts = jax.random.categorical(key, logits, axis=-1)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), acts[..., None], -1)[..., 0]
        return acts, logp

    @jax.jit
    def update(theta, opt_state, task, batch):
        def loss_of(th):
            return loss_fn(policy_outputs(th, task, batch.tokens, act_pos), batch, loss_cfg)

        (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(theta)
        updates, opt_state = opt.update(grads, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state, metrics

    def rollout(theta, task, key):
        acts, logp = map(np.asarray, sample(theta, jnp.asarray(task), key))
        N = len(task)
        tokens = np.zeros((N, T), np.int32)
        tokens[:, act_pos] = acts
        tokens[:, act_pos - 1] = obs_ids  # observation before each decision
        reward = (acts == correct[task]).all(axis=1).astype(np.float32)
        return tokens, logp, reward

    def success(theta, key, n=256):
        task = np.arange(n) % cfg.contexts
        return float(rollout(theta, task, key)[2].mean())

    key = jax.random.PRNGKey(cfg.seed)
    key, k0 = jax.random.split(key)
    before = success(theta, k0)
    curve, t0 = [], time.perf_counter()
    for it in range(cfg.iterations):
        key, k_task, k_roll = jax.random.split(key, 3)
        groups = np.asarray(jax.random.choice(k_task, cfg.contexts, (cfg.tasks_per_iter,), replace=False))
        task = np.repeat(groups, cfg.group_size)  # [N], G episodes per task
        tokens, logp_act, reward = rollout(theta, task, k_roll)
        N = len(task)
        sampler_logp = np.zeros((N, T), np.float32)
        sampler_logp[:, act_pos] = logp_act
        token_rewards = np.zeros((N, T), np.float32)
        token_rewards[:, act_pos[-1]] = reward  # outcome on the last policy token
        ref_logp = policy_outputs(theta_ref, jnp.asarray(task), jnp.asarray(tokens), act_pos).logp
        batch = TrainBatch(
            tokens=jnp.asarray(tokens), positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T)),
            attention_mask=jnp.ones((N, T), jnp.int32), loss_mask=jnp.asarray(np.tile(loss_mask_row, (N, 1))),
            sampler_logp=jnp.asarray(sampler_logp), turn_id=jnp.asarray(np.tile(np.arange(T) // 2, (N, 1)), jnp.int32),
            token_rewards=jnp.asarray(token_rewards), group_id=jnp.asarray(task, jnp.int32),
            reward=jnp.asarray(reward), ref_logp=ref_logp, old_logp=jnp.asarray(sampler_logp),
        )
        theta, opt_state, metrics = update(theta, opt_state, jnp.asarray(task), batch)
        curve.append(float(reward.mean()))
        if verbose and (it % 10 == 0 or it == cfg.iterations - 1):
            print(f"iter {it:4d}  batch success {curve[-1]:.3f}  loss {float(metrics['loss']):+.4f}"
                  f"  entropy {float(metrics['entropy']):.3f}")
    key, k1 = jax.random.split(key)
    after = success(theta, k1)
    result = {"algo": cfg.algo, "success_before": before, "success_after": after,
              "batch_success_curve": curve, "seconds": time.perf_counter() - t0}
    if verbose:
        print(f"success (256 sampled episodes): before {before:.3f} -> after {after:.3f} "
              f"({cfg.algo}, {cfg.iterations} updates, {result['seconds']:.1f}s)")
    return result
