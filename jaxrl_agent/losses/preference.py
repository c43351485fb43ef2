"""DEVICE: preference losses on sequence-level scores, one entry per (chosen, rejected) pair.

`dpo_loss` (DPO / IPO on policy and reference sequence log-probs, see
`losses.sequence_logp`) and `bradley_terry_loss` (a scalar reward model's pairwise loss,
scores read at `last_token_index`). Pure and jittable; re-exported by `losses`, where
DESIGN §4 names them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dpo_loss", "last_token_index", "bradley_terry_loss"]


def dpo_loss(
    chosen_logp: jax.Array,
    rejected_logp: jax.Array,
    ref_chosen_logp: jax.Array,
    ref_rejected_logp: jax.Array,
    *,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict]:
    """Direct preference optimisation on sequence log-probs (one entry per pair).

        h = (chosen - rejected) - (ref_chosen - ref_rejected)
        sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (cDPO smoothing)
        ipo:     (h - 1 / (2 beta))^2
        loss = mean over pairs

    Args: four f32 [P] sequence log-probs (see `sequence_logp`); beta; kind; label_smoothing.
    Returns: (loss, metrics) with reward accuracy and margin (implicit rewards beta * ...).
    Reference: Rafailov et al. 2023 (DPO); Azar et al. 2023 (IPO).
    """
    shapes = {chosen_logp.shape, rejected_logp.shape, ref_chosen_logp.shape, ref_rejected_logp.shape}
    if len(shapes) != 1 or chosen_logp.ndim != 1:
        raise ValueError(f"dpo_loss expects four [P] arrays of one shape, got {shapes}")
    h = (chosen_logp - rejected_logp) - (ref_chosen_logp - ref_rejected_logp)
    if kind == "sigmoid":
        per_pair = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    elif kind == "ipo":
        per_pair = jnp.square(h - 1.0 / (2.0 * beta))
    else:
        raise ValueError(f"unknown DPO kind {kind!r}; expected 'sigmoid' or 'ipo'")
    r_c = beta * (chosen_logp - ref_chosen_logp)
    r_r = beta * (rejected_logp - ref_rejected_logp)
    loss = per_pair.mean()
    return loss, {"dpo_loss": loss, "reward_accuracy": (r_c > r_r).astype(h.dtype).mean(),
                  "reward_margin": (r_c - r_r).mean(), "chosen_reward": r_c.mean(), "rejected_reward": r_r.mean()}



# ---- reward model (Bradley-Terry) ----
def last_token_index(mask: jax.Array) -> jax.Array:
    """Index of the last `mask == 1` position of each row: int32 [B, T] mask -> [B].

    A row without any such position gets T - 1 (callers weight it out)."""
    if mask.ndim != 2:
        raise ValueError(f"expected a [B, T] mask, got {mask.shape}")
    t = mask.shape[1]
    return (t - 1 - jnp.argmax(jnp.flip(mask > 0, axis=1), axis=1)).astype(jnp.int32)


def bradley_terry_loss(
    chosen: jax.Array,
    rejected: jax.Array,
    *,
    margin: float | jax.Array = 0.0,
    label_smoothing: float = 0.0,
    weights: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Bradley-Terry pairwise loss of a scalar reward model (one entry per pair).

        P(chosen > rejected) = sigmoid(r_c - r_r)
        x = r_c - r_r - margin
        per_pair = -(1 - eps) log sigmoid(x) - eps log sigmoid(-x)
        loss = sum(w per_pair) / max(sum(w), 1)

    Args:
      chosen, rejected: f32 [P] scores of the preferred and the other episode of each pair.
      margin: scalar or f32 [P]; the chosen score must exceed the rejected one by this much
        before the loss flattens (Llama 2 uses a margin growing with the preference strength).
      label_smoothing: eps in [0, 0.5), the probability that a label is flipped (conservative
        targets; eps = 0 is the plain maximum-likelihood loss).
      weights: optional f32 [P], 1 on real pairs and 0 on padding pairs (default: all 1).
    Returns:
      (loss, metrics): rm_loss; rm_accuracy, the weighted share of pairs with r_c > r_r, a
      tie counting 1/2 (so an untrained model with all scores equal sits at 0.5);
      rm_margin = mean(r_c - r_r); chosen_score; rejected_score.
    Reference: Bradley & Terry (1952); Ouyang et al. 2022 (InstructGPT); Touvron et al. 2023
      (Llama 2, margin).
    """
    if chosen.ndim != 1 or chosen.shape != rejected.shape:
        raise ValueError(f"bradley_terry_loss expects two [P] arrays of one shape, got {chosen.shape}, {rejected.shape}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    w = jnp.ones_like(chosen) if weights is None else weights.astype(chosen.dtype)
    if w.shape != chosen.shape:
        raise ValueError(f"weights {w.shape} must match the scores {chosen.shape}")
    diff = chosen - rejected
    x = diff - margin
    per_pair = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(x) - label_smoothing * jax.nn.log_sigmoid(-x)
    n = jnp.maximum(w.sum(), 1.0)

    def mean(v):
        return (w * v).sum() / n

    loss = mean(per_pair)
    correct = jnp.where(diff > 0, 1.0, jnp.where(diff == 0, 0.5, 0.0))
    return loss, {"rm_loss": loss, "rm_accuracy": mean(correct), "rm_margin": mean(diff),
                  "chosen_score": mean(chosen), "rejected_score": mean(rejected)}
