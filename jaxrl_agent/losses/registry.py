"""DEVICE: the algorithms as swappable `LossFn`s, the `LOSSES` registry, and the one advantage
path: which estimator each algorithm uses (`LOSS_ADVANTAGES`) and its computation
(`estimate_advantages`).

    LossFn = Callable[[PolicyOutputs, TrainBatch, LossConfig], tuple[jax.Array, dict]]

    TrainBatch --(TrainStep, before a mini-batch split)--> estimate_advantages(LOSS_ADVANTAGES[algo])
               --> batch.advantages (+ returns) --> LOSSES[algo] reads them
    (a batch without them: the loss calls estimate_advantages itself, on the rows it is given)

Each entry composes kernels from kernels.py and advantages.py, always under `stop_gradient`.
`old_logp` falls back to `sampler_logp` (fully on-policy data).

`REWARD_MODEL_LOSSES` holds the LossFns that train a reward model's scalar head
(Bradley-Terry) through the same train step.

`ALGORITHM_DEFAULTS` holds the LossConfig each algorithm is usually run with; passing another
config (or another function) is how a user swaps things.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_agent import advantages as adv_lib
from jaxrl_agent.config import LossConfig
from jaxrl_agent.losses import kernels as L
from jaxrl_agent.losses.preference import bradley_terry_loss, dpo_loss, last_token_index
from jaxrl_agent.structs import PolicyOutputs, TrainBatch

LossFn = Callable[[PolicyOutputs, TrainBatch, LossConfig], tuple[jax.Array, dict]]

sg = jax.lax.stop_gradient


# ---- shared pieces ----
def _old_logp(batch: TrainBatch) -> jax.Array:
    return batch.sampler_logp if batch.old_logp is None else batch.old_logp


def _is_weights(batch: TrainBatch, cfg: LossConfig) -> jax.Array | None:
    """Truncated IS: min(pi_old / pi_sampler, cap) corrects sampler/trainer mismatch."""
    if cfg.tis_cap is None or batch.old_logp is None:
        return None
    return sg(jnp.minimum(jnp.exp(jnp.clip(batch.old_logp - batch.sampler_logp, -20.0, 20.0)), cfg.tis_cap))


def estimate_advantages(batch: TrainBatch, kind: str, cfg: LossConfig) -> tuple[jax.Array, jax.Array | None]:
    """The one advantage computation, `[B, T]` over all rows of `batch` (zero off the loss mask),
    and the value targets when the estimator has them (GAE's returns; None otherwise).

    kind: "grpo" / "dr_grpo" (std-normalised when `cfg.norm_by_std` and kind is "grpo") / "rloo":
    an outcome advantage of `reward` per `group_id`, broadcast on the policy tokens; "gae":
    critic values `old_values` (0 without a critic), whitened over the batch if
    `cfg.whiten_advantages`; "reinforce_pp": KL-shaped token rewards (when `ref_logp` and
    `cfg.kl_coef` are set; the behaviour policy's log-probs), discounted and whitened.
    Every loss below and `TrainStep` (before a mini-batch split) call this; no gradient flows.
    """
    m = batch.loss_mask
    if kind in ("grpo", "dr_grpo"):
        a = adv_lib.grpo(batch.reward, batch.group_id, norm_by_std=cfg.norm_by_std and kind == "grpo")
        return sg(adv_lib.broadcast(a, m)), None
    if kind == "rloo":
        return sg(adv_lib.broadcast(adv_lib.rloo(batch.reward, batch.group_id), m)), None
    if kind == "gae":
        values = jnp.zeros_like(batch.token_rewards) if batch.old_values is None else batch.old_values
        a, returns = adv_lib.gae(batch.token_rewards, values, m, gamma=cfg.gamma, lam=cfg.lam)
        return sg(adv_lib.whiten(a, m) if cfg.whiten_advantages else a), sg(returns)
    if kind == "reinforce_pp":
        r = batch.token_rewards
        if batch.ref_logp is not None and cfg.kl_coef:
            r = r - cfg.kl_coef * L.kl_penalty(_old_logp(batch), batch.ref_logp, cfg.kl_kind) * m.astype(r.dtype)
        return sg(adv_lib.reinforce_pp(r, m, gamma=cfg.gamma)), None
    raise ValueError(f"unknown advantage {kind!r}; expected one of {ESTIMATORS}")


def _advantages(batch: TrainBatch, kind: str, cfg: LossConfig) -> tuple[jax.Array, jax.Array | None]:
    """The batch's precomputed advantages (and value targets) when it has them, else `kind`'s."""
    if batch.advantages is not None:
        return sg(batch.advantages), None if batch.returns is None else sg(batch.returns)
    return estimate_advantages(batch, kind, cfg)


def _regularisers(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig, agg: str) -> tuple[jax.Array, dict]:
    """KL-to-reference loss term and entropy bonus shared by the policy-gradient losses."""
    extra, metrics = jnp.zeros((), out.logp.dtype), {}
    if batch.ref_logp is not None:
        kl = L.aggregate(L.kl_penalty(out.logp, batch.ref_logp, cfg.kl_kind), batch.loss_mask, agg)
        metrics["kl"] = kl
        if cfg.kl_coef:
            extra = extra + cfg.kl_coef * kl
    ent = L.entropy_bonus(out.entropy, batch.loss_mask, agg)
    metrics["entropy"] = ent
    if cfg.entropy_coef:
        extra = extra - cfg.entropy_coef * ent
    return extra, metrics


def _finish(pg: jax.Array, pg_metrics: dict, out, batch, cfg, agg, adv) -> tuple[jax.Array, dict]:
    extra, reg_metrics = _regularisers(out, batch, cfg, agg)
    loss = pg + extra
    metrics = {**pg_metrics, **reg_metrics, "loss": loss, "adv_mean": L.masked_mean(adv, batch.loss_mask)}
    w = _is_weights(batch, cfg)
    if w is not None:  # how far the sampler's policy is from the trainer's (one-step-off rollouts)
        metrics["tis_weight_mean"] = L.masked_mean(w, batch.loss_mask)
        metrics["tis_capped_share"] = L.masked_mean((w >= cfg.tis_cap).astype(w.dtype), batch.loss_mask)
    return loss, metrics


def _clip_loss(out, batch, cfg, adv, agg):
    return L.ppo_policy_loss(out.logp, _old_logp(batch), adv, batch.loss_mask, clip_low=cfg.clip_low,
                             clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=agg,
                             is_weights=_is_weights(batch, cfg))


# ---- the algorithms ----
def ppo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """PPO: GAE advantages from token rewards and the critic's old values (values 0 without
    a critic), optional whitening, clipped surrogate, KL term, entropy, clipped value loss."""
    adv, returns = _advantages(batch, "gae", cfg)
    pg, metrics = _clip_loss(out, batch, cfg, adv, cfg.agg)
    loss, metrics = _finish(pg, metrics, out, batch, cfg, cfg.agg, adv)
    if out.values is not None and batch.old_values is not None and returns is not None:
        vl, vm = L.value_loss(out.values, batch.old_values, returns, batch.loss_mask,
                              cliprange_value=cfg.cliprange_value, agg="token-mean")
        loss = loss + cfg.vf_coef * vl
        metrics = {**metrics, **vm, "loss": loss}
    return loss, metrics


def grpo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """GRPO: group-normalised outcome advantage on every policy token, PPO clip, KL to the
    reference as a loss term (estimator `cfg.kl_kind`, weight `cfg.kl_coef`)."""
    adv, _ = _advantages(batch, "grpo", cfg)
    pg, metrics = _clip_loss(out, batch, cfg, adv, cfg.agg)
    return _finish(pg, metrics, out, batch, cfg, cfg.agg, adv)


def dr_grpo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """Dr.GRPO: GRPO without the std normalisation and with the constant-horizon aggregation."""
    return grpo_loss(out, batch, replace(cfg, norm_by_std=False, agg="seq-mean-token-sum-norm"))


def dapo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """DAPO: group advantages, clip-higher (`cfg.clip_high`, 0.28 in its defaults), token-mean
    aggregation and no KL term. Dynamic sampling (dropping zero-variance groups) is done by
    the rollout, before the batch exists."""
    return grpo_loss(out, batch, replace(cfg, agg="token-mean", kl_coef=0.0))


def gspo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """GSPO: group advantages with the sequence-level clipped ratio."""
    adv, _ = _advantages(batch, "grpo", cfg)
    pg, metrics = L.gspo_policy_loss(out.logp, _old_logp(batch), adv, batch.loss_mask,
                                     clip_low=cfg.gspo_clip_low, clip_high=cfg.gspo_clip_high, agg=cfg.agg)
    return _finish(pg, metrics, out, batch, cfg, cfg.agg, adv)


def cispo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """CISPO: group advantages with clipped stop-gradient IS weights on every token."""
    adv, _ = _advantages(batch, "grpo", cfg)
    pg, metrics = L.cispo_policy_loss(out.logp, _old_logp(batch), adv, batch.loss_mask,
                                      clip_high=cfg.cispo_clip_high, clip_low=cfg.cispo_clip_low, agg=cfg.agg)
    return _finish(pg, metrics, out, batch, cfg, cfg.agg, adv)


def rloo_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """RLOO: leave-one-out group baseline, PPO clip."""
    adv, _ = _advantages(batch, "rloo", cfg)
    pg, metrics = _clip_loss(out, batch, cfg, adv, cfg.agg)
    return _finish(pg, metrics, out, batch, cfg, cfg.agg, adv)


def reinforce_pp_loss(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """REINFORCE++: the KL to the reference goes into the token rewards (k-estimator of the
    behaviour policy, stop-gradient), then whitened discounted returns, PPO clip."""
    adv, _ = _advantages(batch, "reinforce_pp", cfg)
    pg, metrics = _clip_loss(out, batch, cfg, adv, cfg.agg)
    # KL already in the reward: only the entropy regulariser is added here.
    return _finish(pg, metrics, out, batch, replace(cfg, kl_coef=0.0), cfg.agg, adv)


def sft_loss_fn(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """SFT: masked NLL on the assistant (loss_mask == 1) tokens."""
    loss = L.sft_loss(out.logp, batch.loss_mask, cfg.agg)
    return loss, {"loss": loss, "nll": loss, "entropy": L.entropy_bonus(out.entropy, batch.loss_mask, cfg.agg)}


def dpo_loss_fn(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """DPO on a batch of pairs: rows 2i (chosen) and 2i+1 (rejected) share a prompt; needs
    `ref_logp`. Sequence log-probs sum over loss_mask == 1 tokens."""
    if batch.ref_logp is None:
        raise ValueError("dpo needs batch.ref_logp (reference-policy log-probs)")
    B = out.logp.shape[0]
    if B % 2:
        raise ValueError(f"dpo needs an even batch of (chosen, rejected) rows, got B={B}")
    seq = L.sequence_logp(out.logp, batch.loss_mask)
    ref = L.sequence_logp(batch.ref_logp, batch.loss_mask)
    loss, metrics = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=cfg.dpo_beta,
                               kind=cfg.dpo_kind, label_smoothing=cfg.dpo_label_smoothing)
    return loss, {**metrics, "loss": loss}


def reward_scores(out: PolicyOutputs, batch: TrainBatch) -> jax.Array:
    """A reward model's score of every row: its scalar head at the row's last policy token.

    `out.values[:, t]` is read from position t - 1 (model.outputs.policy_outputs), so the head at the
    last policy token `l` is `values[:, l + 1]`; `reward_model.pair_batch` appends one slot
    after every episode so that index exists. f32 [B]."""
    if out.values is None:
        raise ValueError("a reward model needs a scalar head: build it with ModelConfig(value_head=True) "
                         "(reward_model.with_scalar_head)")
    t = out.values.shape[1]
    idx = jnp.minimum(last_token_index(batch.loss_mask) + 1, t - 1)
    return jnp.take_along_axis(out.values, idx[:, None], axis=1)[:, 0]


def bradley_terry_loss_fn(out: PolicyOutputs, batch: TrainBatch, cfg: LossConfig):
    """Reward model: Bradley-Terry loss on rows 2i (chosen) / 2i+1 (rejected) as
    `reward_model.pair_batch` lays them out; scores from `reward_scores`. Pairs with a side
    holding no policy token (padding pairs) are weighted out."""
    B = batch.loss_mask.shape[0]
    if B % 2:
        raise ValueError(f"bradley_terry needs an even batch of (chosen, rejected) rows, got B={B}")
    score = reward_scores(out, batch)
    has = batch.loss_mask.sum(axis=1) > 0
    w = (has[0::2] & has[1::2]).astype(score.dtype)
    loss, metrics = bradley_terry_loss(score[0::2], score[1::2], margin=cfg.rm_margin,
                                         label_smoothing=cfg.rm_label_smoothing, weights=w)
    return loss, {**metrics, "loss": loss}


LOSSES: dict[str, LossFn] = {
    "ppo": ppo_loss,
    "grpo": grpo_loss,
    "dr_grpo": dr_grpo_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "rloo": rloo_loss,
    "reinforce_pp": reinforce_pp_loss,
    "sft": sft_loss_fn,
    "dpo": dpo_loss_fn,
}

# The advantage each loss derives when the batch brings none (`estimate_advantages`'s kinds;
# None: the loss reads no advantage): the one table the train step reads. Every estimator but
# a per-sequence one without whitening couples the rows of a batch (group statistics, whitening
# over the batch), so with `num_mini_batches` > 1 `TrainStep` computes it once over the whole
# batch before the split, and the loss's own fallback only serves a batch that is not split.
# "grpo" follows `LossConfig.norm_by_std` (False in Dr. GRPO's defaults), as the losses do.
LOSS_ADVANTAGES: dict[str, str | None] = {
    "ppo": "gae", "grpo": "grpo", "dr_grpo": "dr_grpo", "dapo": "grpo", "gspo": "grpo", "cispo": "grpo",
    "rloo": "rloo", "reinforce_pp": "reinforce_pp", "sft": None, "dpo": None,
}
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "gae", "reinforce_pp")
# The estimators whose rows form groups (`group_id`): the GRPO family and RLOO.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# The losses that learn from rewards (every one with an advantage): what the RL loop, the
# bandit and the CLI accept as an RL algorithm. "sft" and "dpo" train a policy from data.
RL_LOSSES = tuple(name for name, kind in LOSS_ADVANTAGES.items() if kind is not None)


def advantage_of(loss_fn: LossFn) -> str | None:
    """The advantage `loss_fn` derives (`LOSS_ADVANTAGES`), or None for a function not in
    `LOSSES` (a user's own LossFn: the step cannot know, see `TrainConfig.advantage`)."""
    return next((LOSS_ADVANTAGES[n] for n, f in LOSSES.items() if f is loss_fn), None)


# Losses that train a scorer (a reward model's scalar head), not a policy: the same LossFn
# signature and the same train step, kept out of LOSSES because they read `values`, not
# `logp`, and LOSSES is what the RL / SFT code and tests iterate as "trains a policy".
REWARD_MODEL_LOSSES: dict[str, LossFn] = {
    "bradley_terry": bradley_terry_loss_fn,
}

ALGORITHM_DEFAULTS: dict[str, LossConfig] = {
    "ppo": LossConfig(agg="token-mean", kl_coef=0.0, gamma=1.0, lam=0.95),
    "grpo": LossConfig(agg="seq-mean-token-mean", kl_coef=0.001, kl_kind="k3"),
    "dr_grpo": LossConfig(agg="seq-mean-token-sum-norm", norm_by_std=False, kl_coef=0.0),
    "dapo": LossConfig(agg="token-mean", clip_low=0.2, clip_high=0.28, kl_coef=0.0),
    "gspo": LossConfig(agg="seq-mean-token-mean", kl_coef=0.0),
    "cispo": LossConfig(agg="token-mean", kl_coef=0.0),
    "rloo": LossConfig(agg="token-mean", kl_coef=0.0),
    "reinforce_pp": LossConfig(agg="token-mean", kl_coef=0.001, kl_kind="k1", gamma=1.0),
    "sft": LossConfig(agg="token-mean"),
    "dpo": LossConfig(dpo_beta=0.1, dpo_kind="sigmoid"),
    "bradley_terry": LossConfig(rm_margin=0.0, rm_label_smoothing=0.0),
}
