"""HOST: `python -m jaxrl_agent rm-train`: preference pairs (a JSONL file, or collected from a
policy's episodes) -> a Bradley-Terry reward model -> an HF directory with its scalar head.

    pairs (load_preference_pairs | collect_pairs: pairs_from_groups of rollouts)
      -> train / held-out split -> loops.reward_model.train_reward_model
      -> agent.reward_model.RewardModel (frozen) -> pair accuracy -> save_reward_model
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import numpy as np

from jaxrl_agent import hf
from jaxrl_agent.agent.policy import DEMO_POLICY_DIR, load_policy
from jaxrl_agent.agent.preference_pairs import (Pair, PreferenceDataError, load_preference_pairs, pairs_from_groups,
                                                save_preference_pairs)
from jaxrl_agent.agent.reward_model import RewardModel, pair_accuracy, save_reward_model, with_scalar_head
from jaxrl_agent.agent.rollout import collect_episodes
from jaxrl_agent.config import LossConfig, OptimConfig, RolloutConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import generate_tasks
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.loops.metrics import MetricsLogger
from jaxrl_agent.loops.reward_model import RM_BUCKETS, train_reward_model
from jaxrl_agent.losses.registry import ALGORITHM_DEFAULTS
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import episode_engine
from jaxrl_agent.tokenizer import ChatFormat


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
    model, tok = load_policy(cfg.init)
    sampling = episode_engine(tok, rollout, seed=cfg.seed)
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        eps, _ = collect_episodes(generate_tasks("train", cfg.num_tasks, cfg.seed), SamplingEngine(model, sampling),
                                  ChatFormat(tok, tool_style="short"), sandbox, replace(rollout, group_size=cfg.group_size),
                                  tools, seed=cfg.seed)
    pairs = pairs_from_groups(eps, cfg.max_pairs_per_group, cfg.seed)
    return pairs, {"episodes": len(eps), "success": float(np.mean([e.reward >= 1.0 for e in eps]))}


def run_rm_train_job(cfg: RMTrainRunConfig, *, show_progress: bool = True) -> dict:
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
