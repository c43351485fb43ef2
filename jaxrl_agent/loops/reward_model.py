"""HOST: Bradley-Terry training of a reward model (a CausalLM with a scalar head,
`agent.reward_model.with_scalar_head`) on preference pairs, through the policy's train step.

    pairs --DataIterator--> pair_batch (rows 2i chosen / 2i+1 rejected)
      --make_train_step(REWARD_MODEL_LOSSES["bradley_terry"])--> state
    the trained scorer: `agent.reward_model.RewardModel(ts.to_model(ts.host_policy_params(state)))`
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Sequence

import jax

from jaxrl_agent.agent.preference_pairs import Pair, pair_batch
from jaxrl_agent.config import OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.loops.offline import DataIterator
from jaxrl_agent.losses.registry import REWARD_MODEL_LOSSES
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.train import sharding as sh
from jaxrl_agent.train.step import TrainState, TrainStep, make_optimizer, make_train_step

# +1: the scoring slot `pair_batch` appends after every episode.
RM_BUCKETS = tuple(b + 1 for b in TrajectoryConfig().buckets)


def train_reward_model(
    model: CausalLM,
    pairs: Sequence[Pair],
    *,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    traj_cfg: TrajectoryConfig,
    num_steps: int,
    batch_size: int,
    seed: int = 0,
    mesh=None,
    on_step: Callable[[int, dict], None] | None = None,
) -> tuple[TrainState, list[dict], TrainStep]:
    """Bradley-Terry training of `model` (a CausalLM with a scalar head) on (chosen,
    rejected) pairs through `make_train_step`; `batch_size` counts pairs.

    Mini-batch shuffling would separate rows 2i / 2i+1, so it is turned off; LoRA is refused
    (the adapters do not cover the scalar head, which would stay at zero).
    Returns (final state, per-step metrics as floats, the TrainStep): the trained reward
    model is `ts.to_model(ts.host_policy_params(state))`.
    """
    if not model.config.value_head:
        raise ValueError("train_reward_model needs a scalar head: pass with_scalar_head(policy)")
    if train_cfg.lora.rank:
        raise ValueError("LoRA adapters do not cover the reward model's scalar head; train it with lora.rank=0")
    if not pairs:
        raise ValueError("train_reward_model needs at least one preference pair")
    train_cfg = replace(train_cfg, shuffle=False, use_ref=False)
    ts = make_train_step(REWARD_MODEL_LOSSES["bradley_terry"], make_optimizer(optim_cfg), train_cfg, model, mesh=mesh)
    multiple = math.lcm(traj_cfg.batch_multiple, sh.batch_size_multiple(ts.mesh), 2)
    data = DataIterator(pairs, batch_size, seed=seed)
    state = ts.init_state(model, seed=seed)
    history: list[dict] = []
    for step in range(1, num_steps + 1):
        t0 = time.perf_counter()
        batch = pair_batch(data.next(), replace(traj_cfg, batch_multiple=multiple))
        state, metrics = ts(state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics["step_time_s"] = time.perf_counter() - t0
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return state, history, ts
