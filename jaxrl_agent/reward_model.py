"""HOST + DEVICE: a reward model, the policy's decoder with a scalar head.

    pairs (chosen, rejected) of episodes --pair_batch--> TrainBatch (rows 2i / 2i+1)
      --make_train_step(REWARD_MODEL_LOSSES["bradley_terry"])--> the same jitted, sharded step
      as the policy (only the LossFn differs: it reads `values`, the scalar head)
    -> save_reward_model (HF directory + value_head.safetensors) / load_reward_model
    -> RewardModel: frozen scoring of episodes in batches on device, for the RL loop

The score of an episode is the scalar head read at its **last policy token**, i.e. after the
model has seen the whole episode up to and including the policy's last action. The model is
`model.CausalLM` with `ModelConfig(value_head=True)`: the head (`value_w`, `value_b`) is
exported and loaded exactly like a critic's, so `hf.py` needs nothing new.

Pairs (preference_pairs.py) come from a user's JSONL (`load_preference_pairs`) or from the loop itself
(`pairs_from_groups`: two episodes of one task whose verifier rewards differ).

A `RewardModel` holds a private copy of its parameters and only a forward pass is ever
compiled for it: nothing in the RL loop can update it (tests check the parameters are
bit-identical before and after a policy update).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agent import hf
from jaxrl_agent import sharding as sh
from jaxrl_agent.config import LossConfig, OptimConfig, RolloutConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.loss_registry import ALGORITHM_DEFAULTS, REWARD_MODEL_LOSSES
from jaxrl_agent.model import CausalLM
from jaxrl_agent.offline import DataIterator
from jaxrl_agent.pipelines import DEMO_POLICY_DIR
from jaxrl_agent.train_step import TrainState, TrainStep, make_optimizer, make_train_step
from jaxrl_agent.preference_pairs import (Pair, PreferenceDataError, load_preference_pairs,  # noqa: F401 (API)
                                          pair_batch, pairs_from_groups, save_preference_pairs)
from jaxrl_agent.trajectory import Episode, collate

META_FILE = "reward_model.json"


# ---- the model ----
def with_scalar_head(model: CausalLM) -> CausalLM:
    """A reward model that starts from `model`'s decoder: a copy of every weight plus a scalar
    head (zero-initialised, so every score starts at 0 and the Bradley-Terry loss at log 2).
    A model that already has a head keeps it. The policy's arrays are never shared."""
    cfg = replace(model.config, value_head=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    dtype = params["embed"].dtype
    out = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    for (name,), var in nnx.to_flat_state(nnx.state(out, nnx.Param)):
        value = params.get(name)
        getattr(out, name).set_value(jnp.zeros(var.shape, dtype) if value is None else jnp.array(value, copy=True))
    return out


def save_reward_model(model: CausalLM, path: str, meta: dict | None = None) -> None:
    """Write a reward model as an HF directory (config.json, model.safetensors,
    value_head.safetensors) plus `reward_model.json` (how it scores, training figures)."""
    if not model.config.value_head:
        raise ValueError("not a reward model: the model has no scalar head (use with_scalar_head)")
    hf.save_pretrained(model, model.config, path)
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"kind": "bradley_terry", "score": "scalar head at the last policy token", **(meta or {})}, f,
                  indent=2, default=str)


def load_reward_model(path: str, dtype=jnp.float32) -> CausalLM:
    """Load a directory written by `save_reward_model` (or `rm-train`) as a `CausalLM` with
    its scalar head; a policy directory without a head is refused, not zero-filled."""
    if not os.path.exists(os.path.join(path, hf.VALUE_HEAD_FILE)):
        raise FileNotFoundError(f"{path!r} has no {hf.VALUE_HEAD_FILE}: not a reward model (train one with "
                                "`python -m jaxrl_agent rm-train`)")
    return hf.load_pretrained(path, dtype, value_head=True)[0]


# ---- frozen scoring ----
class RewardModel:
    """Frozen scorer: episodes -> float32 `[N]`, the scalar head at each last policy token.

    Args:
      model: a `CausalLM` with a scalar head; its parameters are copied (the caller's model,
        even the policy itself, can change or be donated without touching the scorer).
      traj: length buckets for the scoring batches (the episodes' longest must fit).
      batch_size: rows per scoring call; every call has this many rows (padding rows are
        added), so the forward compiles once per length bucket.
    """

    def __init__(self, model: CausalLM, traj: TrajectoryConfig = TrajectoryConfig(), batch_size: int = 16):
        if not model.config.value_head:
            raise ValueError("a reward model needs a scalar head (ModelConfig.value_head=True; see with_scalar_head)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config, self.batch_size = model.config, batch_size
        self.traj = replace(traj, batch_multiple=1, row_buckets=(batch_size,), pack=False, overflow="error")
        graphdef, state = nnx.split(model)
        self.params = jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # private copy, never donated
        self._score_rows = jax.jit(lambda params, *rows: _score_rows(graphdef, params, *rows))

    def score(self, episodes: Sequence[Episode]) -> np.ndarray:
        """Scores of `episodes` (float32 `[N]`), in order. An episode with no policy token is
        scored at its last token."""
        if not episodes:
            return np.zeros((0,), np.float32)
        top = max(max(e.ids) for e in episodes)
        if top >= self.config.vocab_size:
            raise ValueError(f"token id {top} >= the reward model's vocab size {self.config.vocab_size}: the reward "
                             "model must share the policy's tokenizer")
        order = sorted(range(len(episodes)), key=lambda i: len(episodes[i]))  # similar lengths share a bucket
        out = np.zeros(len(episodes), np.float32)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            bare = [replace(episodes[i], reward=0.0, turn_rewards={}) for i in idx]
            batch, _ = collate(bare, self.traj)
            real = batch.attention_mask > 0
            last = np.where(batch.loss_mask.any(1), _last(batch.loss_mask), _last(real))  # [B]
            scores = self._score_rows(self.params, batch.tokens, batch.positions, batch.attention_mask, last)
            out[idx] = np.asarray(scores)[: len(idx)]
        return out


def _last(mask: np.ndarray) -> np.ndarray:
    """Index of the last nonzero entry of each row of a [B, T] mask (0 for an empty row)."""
    t = mask.shape[1]
    return np.where(mask.any(1), t - 1 - np.argmax(mask[:, ::-1] > 0, axis=1), 0).astype(np.int32)


def _score_rows(graphdef, params, tokens, positions, attention_mask, last):
    """DEVICE: int32 [B, T] rows, last [B] -> f32 [B]: the head on the hidden state at `last`."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(tokens, positions, attention_mask)  # [B, T, D]
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
    return model.values_from_hidden(h)[:, 0]


def pair_accuracy(rm: RewardModel, pairs: Sequence[Pair]) -> dict:
    """Share of pairs the frozen scorer ranks right (a tie counts 1/2) and the mean margin."""
    if not pairs:
        raise ValueError("pair_accuracy needs at least one pair")
    scores = rm.score([e for pair in pairs for e in pair])
    diff = scores[0::2] - scores[1::2]
    return {"accuracy": float(np.mean(np.where(diff > 0, 1.0, np.where(diff == 0, 0.5, 0.0)))),
            "margin": float(diff.mean()), "pairs": len(pairs)}


# ---- training ----
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


# ---- `python -m jaxrl_agent rm-train` ----
# +1: the scoring slot `pair_batch` appends after every episode.
RM_BUCKETS = tuple(b + 1 for b in TrajectoryConfig().buckets)


@dataclass(frozen=True)
class RMConfig:
    """`rm-train`: preference pairs -> a Bradley-Terry reward model -> HF directory."""

    pairs: str = ""
    """JSONL of preference pairs (see load_preference_pairs); "" collects pairs from rollouts of
    `init` on training tasks (two episodes of a task whose verifier rewards differ)."""
    init: str = DEMO_POLICY_DIR
    """HF policy directory: the reward model starts from its decoder (and, when pairs are
    collected, it plays the episodes)."""
    num_tasks: int = 32
    """Collected pairs: training tasks played."""
    group_size: int = 8
    """Collected pairs: episodes per task."""
    max_pairs_per_group: int = 8
    """Collected pairs: most pairs taken from one task's group."""
    heldout_fraction: float = 0.2
    """Share of the pairs held out from training; the pair accuracy on them is reported."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 8
    """Pairs per step."""
    learning_rate: float = 1e-4
    """AdamW peak learning rate (cosine decay to 10%)."""
    run_dir: str = "runs/rm"
    """Output: pairs.jsonl (when collected), metrics, rm_summary.json, <run_dir>/reward_model."""
    seed: int = 0
    """Seed of tasks, sampling, the held-out split and batch order."""
    sandbox_workers: int = 2
    """Sandbox workers for collected pairs (tests and verifier)."""


@dataclass(frozen=True)
class RMTrainRunConfig:
    rm: RMConfig = field(default_factory=RMConfig)
    loss: LossConfig = field(default_factory=lambda: ALGORITHM_DEFAULTS["bradley_terry"])
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolConfig = field(default_factory=ToolConfig)


def collect_pairs(cfg: RMConfig, rollout: RolloutConfig, tools: ToolConfig) -> tuple[list[Pair], dict]:
    """Play `cfg.group_size` episodes of the policy `cfg.init` on each of `cfg.num_tasks`
    training tasks; pairs are `pairs_from_groups` of them."""
    from jaxrl_agent.env.sandbox import Sandbox
    from jaxrl_agent.env.tasks import generate_tasks
    from jaxrl_agent.pipelines import agent_sampling, load_policy
    from jaxrl_agent.rollout import collect_episodes
    from jaxrl_agent.sampling_engine import SamplingEngine
    from jaxrl_agent.tokenizer import ChatFormat

    model, tok = load_policy(cfg.init)
    cache = rollout.max_total_tokens
    sampling = agent_sampling(stop_token_ids=tuple(tok.stop_ids), seed=cfg.seed, cache_size=cache)
    sampling = replace(sampling, prefill_buckets=tuple(b for b in sampling.prefill_buckets if b <= cache) or (cache,))
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        eps, _ = collect_episodes(generate_tasks("train", cfg.num_tasks, cfg.seed), SamplingEngine(model, sampling),
                                  ChatFormat(tok, tool_style="short"), sandbox, replace(rollout, group_size=cfg.group_size),
                                  tools, seed=cfg.seed)
    pairs = pairs_from_groups(eps, cfg.max_pairs_per_group, cfg.seed)
    return pairs, {"episodes": len(eps), "success": float(np.mean([e.reward >= 1.0 for e in eps]))}


def run_rm_train_job(cfg: RMTrainRunConfig, *, show_progress: bool = True) -> dict:
    from jaxrl_agent.metrics import MetricsLogger

    r = cfg.rm
    # ---- pairs ----
    source: dict = {"pairs": r.pairs}
    if r.pairs:
        if not os.path.exists(r.pairs):
            raise FileNotFoundError(f"no preference pairs file {r.pairs!r}")
        pairs = load_preference_pairs(r.pairs)
    else:
        pairs, source = collect_pairs(r, cfg.rollout, cfg.tools)
        source["pairs"] = os.path.join(r.run_dir, "pairs.jsonl")
        save_preference_pairs(source["pairs"], pairs)
    if len(pairs) < 2:
        raise PreferenceDataError(f"{len(pairs)} preference pair(s): a reward model needs at least 2 (one to train "
                                  "on, one held out); collect more, or from a policy whose episodes differ in outcome")
    perm = np.random.default_rng(r.seed).permutation(len(pairs))
    n_held = min(len(pairs) - 1, max(1, round(r.heldout_fraction * len(pairs)))) if r.heldout_fraction > 0 else 0
    held, train = [pairs[i] for i in perm[:n_held]], [pairs[i] for i in perm[n_held:]]
    # ---- train ----
    model = with_scalar_head(hf.load_pretrained(r.init)[0])
    optim = OptimConfig(learning_rate=r.learning_rate, schedule="cosine", warmup_steps=max(1, r.steps // 20),
                        total_steps=r.steps, min_lr_ratio=0.1)
    traj = TrajectoryConfig(buckets=RM_BUCKETS)
    with MetricsLogger(r.run_dir) as log:
        def on_step(step, metrics):
            log.log(step, {"rm": metrics})
            if show_progress and (step % 25 == 0 or step == 1):
                print(f"rm step {step:4d}  loss {metrics['loss']:.4f}  pair accuracy {metrics['rm_accuracy']:.3f}")

        state, hist, ts = train_reward_model(model, train, train_cfg=TrainConfig(loss=cfg.loss), optim_cfg=optim,
                                             traj_cfg=traj, num_steps=r.steps, batch_size=min(r.batch_size, len(train)),
                                             seed=r.seed, on_step=on_step)
    # ---- measure with the frozen scorer, export ----
    trained = ts.to_model(ts.host_policy_params(state))
    scorer = RewardModel(trained, TrajectoryConfig(buckets=RM_BUCKETS))
    summary = {"source": source, "pairs": len(pairs), "train_pairs": len(train), "heldout_pairs": len(held),
               "final_loss": hist[-1]["loss"], "train": pair_accuracy(scorer, train),
               "heldout": pair_accuracy(scorer, held) if held else None, "steps": r.steps,
               "margin": cfg.loss.rm_margin, "label_smoothing": cfg.loss.rm_label_smoothing}
    out = os.path.join(r.run_dir, "reward_model")
    save_reward_model(trained, out, meta=summary)
    summary["reward_model"] = out
    with open(os.path.join(r.run_dir, "rm_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if show_progress:
        acc = summary["heldout"]["accuracy"] if held else float("nan")
        print(f"reward model: train pair accuracy {summary['train']['accuracy']:.3f}, held-out {acc:.3f} "
              f"({len(held)} pairs) -> {out}")
    return summary
