"""DEVICE: losses, the stable path of DESIGN §4 (`jaxrl_agent.losses`).

    kernels.py     per-token kernels: aggregate, kl_penalty, ppo / gspo / cispo policy losses,
                   value_loss, entropy_bonus, sft_loss
    preference.py  per-pair kernels: dpo_loss, bradley_terry_loss
    registry.py    the algorithms as LossFns, `LOSSES`, and the one table of the advantage each
                   algorithm uses (`LOSS_ADVANTAGES`)

This file only re-exports those names for users (`from jaxrl_agent.losses import LOSSES`); the
package's own modules import the module that defines a name (tests/test_layout.py).
"""
from jaxrl_agent.losses.kernels import (AGG_MODES, aggregate, aggregate_parts, cispo_policy_loss, entropy_bonus,
                                        gspo_policy_loss, kl_penalty, masked_mean, ppo_policy_loss, sequence_logp,
                                        sft_loss, value_loss)
from jaxrl_agent.losses.preference import bradley_terry_loss, dpo_loss, last_token_index
from jaxrl_agent.losses.registry import ALGORITHM_DEFAULTS, LOSSES, REWARD_MODEL_LOSSES, LossFn

__all__ = [
    "AGG_MODES", "aggregate", "aggregate_parts", "masked_mean", "kl_penalty", "ppo_policy_loss",
    "gspo_policy_loss", "cispo_policy_loss", "value_loss", "entropy_bonus", "sft_loss", "sequence_logp",
    "dpo_loss", "last_token_index", "bradley_terry_loss", "LOSSES", "LossFn", "ALGORITHM_DEFAULTS",
    "REWARD_MODEL_LOSSES",
]
