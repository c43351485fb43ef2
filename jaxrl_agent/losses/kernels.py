"""DEVICE: the per-token loss kernels (pure, jittable): aggregation, KL, policy, value, SFT.

Kernels take `[B, T]` per-token arrays and a `mask` (1 on policy-sampled tokens); positions
with mask == 0 contribute nothing to the value *and* get exactly zero gradient. Every kernel
returns an unreduced `[B, T]` array or reduces through `aggregate`, whose numerator /
denominator form (`aggregate_parts`) lets micro-batches and data-parallel shards add up to
the full-batch loss exactly.

The registered algorithms (`LOSSES`, in registry.py) all have the `LossFn` signature
`(PolicyOutputs, TrainBatch, LossConfig) -> (loss, metrics)`: the train step computes
`PolicyOutputs` once; a loss never calls the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "AGG_MODES",
    "aggregate",
    "aggregate_parts",
    "masked_mean",
    "kl_penalty",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "value_loss",
    "entropy_bonus",
    "sft_loss",
    "sequence_logp",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_same(**arrays: jax.Array) -> tuple[int, ...]:
    shapes = {k: tuple(v.shape) for k, v in arrays.items() if v is not None}
    first = next(iter(shapes.values()))
    if len(first) != 2:
        raise ValueError(f"expected [B, T] arrays, got {shapes}")
    if any(s != first for s in shapes.values()):
        raise ValueError(f"shape mismatch: {shapes}")
    return first


# ---- aggregation ----
def aggregate_parts(
    per_token: jax.Array, mask: jax.Array, mode: str, *, horizon: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Numerator and denominator of `aggregate`: loss = num / max(den, 1).

    Sums of `num` and of `den` over disjoint row splits of a batch give the full-batch
    (num, den), so gradient accumulation over micro-batches (and psum over data-parallel
    shards) reproduces the full-batch loss exactly.

    Args:
      per_token: f32 [B, T] per-token loss.
      mask: [B, T] 1 on tokens that count.
      mode: one of AGG_MODES:
        "token-mean"              num = sum(l m),             den = sum(m)
        "seq-mean-token-sum"      num = sum_b sum_t l m,       den = #rows with >= 1 token
        "seq-mean-token-mean"     num = sum_b mean_t(l | m),   den = #rows with >= 1 token
        "seq-mean-token-sum-norm" num = sum_b sum_t l m / H,   den = #rows with >= 1 token
      horizon: H for "seq-mean-token-sum-norm" (Dr.GRPO's constant length normaliser);
        defaults to T. Pass the same H to every micro-batch.

    Returns:
      (num, den): f32 scalars.
    """
    _check_same(per_token=per_token, mask=mask)
    m = mask.astype(per_token.dtype)
    lm = per_token * m
    if mode == "token-mean":
        return lm.sum(), m.sum()
    n_tok = m.sum(axis=1)  # [B]
    has_tok = (n_tok > 0).astype(per_token.dtype)
    seq_sum = lm.sum(axis=1)  # [B]
    if mode == "seq-mean-token-sum":
        num = seq_sum.sum()
    elif mode == "seq-mean-token-mean":
        num = (seq_sum / jnp.maximum(n_tok, 1.0)).sum()
    elif mode == "seq-mean-token-sum-norm":
        num = seq_sum.sum() / float(per_token.shape[1] if horizon is None else horizon)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")
    return num, has_tok.sum()


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str = "token-mean", *, horizon: int | None = None) -> jax.Array:
    """Reduce a per-token loss `[B, T]` to a scalar (see `aggregate_parts` for the modes).

    An all-masked batch gives 0 (the denominator is clamped to 1).
    """
    num, den = aggregate_parts(per_token, mask, mode, horizon=horizon)
    return num / jnp.maximum(den, 1.0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x over mask == 1 positions (0 when empty). Used for metrics."""
    return aggregate(x, mask, "token-mean")


# ---- KL estimators ----
def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    kind:
      "k1" / "kl":          logp - ref_logp                       (unbiased, high variance)
      "abs":                |logp - ref_logp|
      "k2" / "mse":         0.5 (logp - ref_logp)^2
      "k3" / "low_var_kl":  exp(d) - d - 1, d = clamp(ref_logp - logp, -20, 20),
                            result clamped to [-10, 10]           (Schulman's k3)
    Args: logp, ref_logp f32 [B, T] (any matching shape).
    Returns: f32 like logp (unmasked; aggregate with the loss mask).
    Reference: J. Schulman, "Approximating KL Divergence" (2020).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {logp.shape} and ref_logp {ref_logp.shape} differ")
    d = logp - ref_logp
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return jnp.abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * jnp.square(d)
    if kind in ("k3", "low_var_kl"):
        r = jnp.clip(-d, -20.0, 20.0)
        return jnp.clip(jnp.exp(r) - r - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1/kl, abs, k2/mse, k3/low_var_kl")


# ---- policy-gradient losses ----
def _ratio_metrics(log_ratio: jax.Array, mask: jax.Array) -> dict:
    ratio = jnp.exp(log_ratio)
    m = mask.astype(bool)
    return {
        "approx_kl": masked_mean(-log_ratio, mask),  # E_old[log old - log new]
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": jnp.max(jnp.where(m, ratio, -jnp.inf), initial=0.0),
        "ratio_min": jnp.min(jnp.where(m, ratio, jnp.inf), initial=jnp.inf),
    }


def ppo_policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    is_weights: jax.Array | None = None,
    horizon: int | None = None,
) -> tuple[jax.Array, dict]:
    """PPO clipped surrogate with asymmetric (clip-higher) and dual clipping.

        ratio = exp(clamp(logp - old_logp, -20, 20))
        l     = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))
        l     = min(l, -A dual_clip)            where A < 0 (dual-clip, Ye et al. 2020)
        l     = l * is_weights                  (optional, e.g. truncated IS; stop-gradient)
        loss  = aggregate(l, mask, agg)

    Args:
      logp, old_logp, advantages: f32 [B, T]; mask [B, T].
      clip_low, clip_high: clip range (DAPO clip-higher: clip_high = 0.28).
      dual_clip: constant c > 1, or None to disable.
      agg: aggregation mode; is_weights: optional f32 [B, T] per-token weights.
    Returns:
      (loss scalar, metrics) with clipfrac (the clipped term was active), clipfrac_lower
      (the dual clip was active), approx_kl, ratio stats.
    Reference: Schulman et al. 2017; Yu et al. 2025 (DAPO).
    """
    _check_same(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, is_weights=is_weights)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = jnp.maximum(l1, l2)
    loss_tok = clipped
    lower = jnp.zeros_like(clipped, dtype=bool)
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        lower = (advantages < 0) & (l3 < clipped)
        loss_tok = jnp.where(advantages < 0, jnp.minimum(clipped, l3), clipped)
    if is_weights is not None:
        loss_tok = loss_tok * jax.lax.stop_gradient(is_weights)
    loss = aggregate(loss_tok, mask, agg, horizon=horizon)
    metrics = {
        "pg_loss": loss,
        "clipfrac": masked_mean((l2 > l1).astype(logp.dtype), mask),
        "clipfrac_lower": masked_mean(lower.astype(logp.dtype), mask),
        **_ratio_metrics(log_ratio, mask),
    }
    return loss, metrics


def gspo_policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    horizon: int | None = None,
) -> tuple[jax.Array, dict]:
    """GSPO: PPO clipping on the length-normalised *sequence* importance ratio.

        s_b      = exp(mean_t(logp - old_logp | mask))           per sequence
        s_{b,t}  = sg(s_b) * exp(logp_t - sg(logp_t))            (value s_b, token gradient)
        l        = max(-A s_{b,t}, -A clip(s_{b,t}, 1 - clip_low, 1 + clip_high))

    Args: as `ppo_policy_loss` (advantages usually a broadcast sequence advantage).
    Returns: (loss, metrics) with clipfrac, approx_kl.
    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization".
    """
    _check_same(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    m = mask.astype(logp.dtype)
    log_ratio = (logp - old_logp) * m
    seq_log_ratio = log_ratio.sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)  # [B]
    seq_log_ratio = jnp.clip(seq_log_ratio, -10.0, 10.0)
    log_s = jax.lax.stop_gradient(seq_log_ratio)[:, None] + logp - jax.lax.stop_gradient(logp)
    s = jnp.exp(log_s)
    l1 = -advantages * s
    l2 = -advantages * jnp.clip(s, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = jnp.maximum(l1, l2)
    loss = aggregate(loss_tok, mask, agg, horizon=horizon)
    metrics = {"pg_loss": loss, "clipfrac": masked_mean((l2 > l1).astype(logp.dtype), mask),
               **_ratio_metrics(jnp.clip(logp - old_logp, -20.0, 20.0), mask)}
    return loss, metrics


def cispo_policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_high: float = 5.0,
    clip_low: float | None = None,
    agg: str = "token-mean",
    horizon: int | None = None,
) -> tuple[jax.Array, dict]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight on every token.

        w = sg(clip(exp(logp - old_logp), 1 - clip_low, 1 + clip_high))
        l = -w * A * logp

    Unlike PPO no token's gradient is dropped: clipping bounds the weight, not the update.
    Args: as `ppo_policy_loss`; clip_low None means no lower bound.
    Returns: (loss, metrics) with clipfrac (weight was clipped), approx_kl.
    Reference: MiniMax-M1 (2025).
    """
    _check_same(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    low = 0.0 if clip_low is None else 1.0 - clip_low
    w = jax.lax.stop_gradient(jnp.clip(ratio, low, 1.0 + clip_high))
    loss_tok = -w * advantages * logp
    loss = aggregate(loss_tok, mask, agg, horizon=horizon)
    clipped = (ratio > 1.0 + clip_high) | (ratio < low)
    metrics = {"pg_loss": loss, "clipfrac": masked_mean(clipped.astype(logp.dtype), mask),
               **_ratio_metrics(log_ratio, mask)}
    return loss, metrics


# ---- critic, entropy, SFT ----
def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    cliprange_value: float | None = 0.2,
    agg: str = "token-mean",
) -> tuple[jax.Array, dict]:
    """Clipped value loss: 0.5 * max((v - R)^2, (old + clip(v - old, -c, c) - R)^2).

    Args: values, old_values, returns f32 [B, T]; mask [B, T]; cliprange_value c (None
      disables clipping).
    Returns: (loss, metrics) with vf_clipfrac and vf_explained_var.
    """
    _check_same(values=values, old_values=old_values, returns=returns, mask=mask)
    vf1 = jnp.square(values - returns)
    if cliprange_value is None:
        vf, clipfrac = vf1, jnp.zeros((), values.dtype)
    else:
        v_clip = old_values + jnp.clip(values - old_values, -cliprange_value, cliprange_value)
        vf2 = jnp.square(v_clip - returns)
        vf = jnp.maximum(vf1, vf2)
        clipfrac = masked_mean((vf2 > vf1).astype(values.dtype), mask)
    loss = 0.5 * aggregate(vf, mask, agg)
    resid = masked_mean(jnp.square(returns - values - masked_mean(returns - values, mask)), mask)
    ret_var = masked_mean(jnp.square(returns - masked_mean(returns, mask)), mask)
    return loss, {"vf_loss": loss, "vf_clipfrac": clipfrac, "vf_explained_var": 1.0 - resid / (ret_var + 1e-8)}


def entropy_bonus(entropy: jax.Array, mask: jax.Array, agg: str = "token-mean") -> jax.Array:
    """Aggregated policy entropy over policy tokens (a loss subtracts coef * this)."""
    return aggregate(entropy, mask, agg)


def sft_loss(logp: jax.Array, mask: jax.Array, agg: str = "token-mean") -> jax.Array:
    """Masked negative log-likelihood: aggregate(-logp, mask) (assistant tokens only)."""
    _check_same(logp=logp, mask=mask)
    return aggregate(-logp, mask, agg)


# ---- sequence log-probs (DPO and other sequence-level losses) ----
def sequence_logp(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum of per-token log-probs over mask == 1: f32 [B, T] -> [B]."""
    _check_same(logp=logp, mask=mask)
    return (logp * mask.astype(logp.dtype)).sum(axis=1)
