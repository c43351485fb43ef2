"""HOST: `python -m jaxrl_agent export`: the latest orbax checkpoint of an RL run -> an HF
directory transformers loads (with the policy's tokenizer).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from jaxrl_agent.agent.policy import PolicyConfig, load_policy
from jaxrl_agent.config import CheckpointConfig, OptimConfig, TrainConfig
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.train.checkpoint import Checkpointer, export_hf
from jaxrl_agent.train.step import make_optimizer, make_train_step


@dataclass(frozen=True)
class ExportConfig:
    """`export`: the latest orbax checkpoint of an RL run -> an HF directory."""

    run_dir: str = "runs/rl"
    """The RL run (its checkpoints are in <run_dir>/checkpoints)."""
    out: str = "runs/exported"
    """Output HF directory."""


@dataclass(frozen=True)
class ExportRunConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy the run started from (gives the architecture)."""
    export: ExportConfig = field(default_factory=ExportConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    """Must match the run's TrainConfig (LoRA rank, mesh) so the checkpoint's structure fits."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(learning_rate=1e-4))
    """Must match the run's optimizer (its state is part of the checkpoint)."""


def run_export_job(cfg: ExportRunConfig, *, show_progress: bool = True) -> dict:
    model, tok = load_policy(cfg.policy.path, cfg.policy.tokenizer)
    ckpt_dir = os.path.join(cfg.export.run_dir, "checkpoints")
    with Checkpointer(CheckpointConfig(directory=ckpt_dir)) as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint under {ckpt_dir!r}")
        step = ckpt.latest_step()
        ts = make_train_step(LOSSES["grpo"], make_optimizer(cfg.optim), cfg.train, model)
        state, _ = ckpt.restore(ts.abstract_state())
    export_hf(ts, state, model.config, cfg.export.out, tokenizer=tok)
    if show_progress:
        print(f"exported step {step} of {cfg.export.run_dir} -> {cfg.export.out}")
    return {"out": cfg.export.out, "step": step}
