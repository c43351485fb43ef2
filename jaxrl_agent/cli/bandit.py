"""HOST: `python -m jaxrl_agent bandit`: the multi-step tool-choice bandit (`loops.bandit`)
trained with any registered loss; prints the success rate as it rises."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxrl_agent.config import LossConfig
from jaxrl_agent.loops.bandit import BanditConfig, train_bandit


@dataclass(frozen=True)
class BanditRunConfig:
    bandit: BanditConfig = field(default_factory=BanditConfig)
    loss: LossConfig = field(default_factory=lambda: LossConfig(kl_coef=0.0))


def run_bandit_job(cfg: BanditRunConfig) -> dict:
    return train_bandit(cfg.bandit, cfg.loss)
