"""HOST: `python -m jaxrl_agent train`: RL (`loops.rl.train_rl`) from an HF policy directory.

    PolicyConfig --agent.policy.load_policy--> (model, tokenizer) --train_rl--> <rl.run_dir>
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxrl_agent.agent.policy import PolicyConfig, load_policy
from jaxrl_agent.config import (OptimConfig, RewardConfig, RLConfig, RolloutConfig, SamplingConfig, TrainConfig,
                                TrajectoryConfig)
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.loops.rl import train_rl
from jaxrl_agent.sampling.engine_config import agent_sampling


@dataclass(frozen=True)
class TrainRunConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=agent_sampling)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(learning_rate=1e-4))
    tools: ToolConfig = field(default_factory=ToolConfig)
    traj: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    resume: bool = False


def run_train_job(cfg: TrainRunConfig, *, show_progress: bool = True) -> dict:
    model, tok = load_policy(cfg.policy.path, cfg.policy.tokenizer)
    return train_rl(model, tok, rl=cfg.rl, rollout=cfg.rollout, sampling=cfg.sampling, train=cfg.train,
                    optim=cfg.optim, tools=cfg.tools, traj=cfg.traj, show_progress=show_progress, resume=cfg.resume,
                    rewards=cfg.rewards)
