"""DEVICE: advantage estimators as pure, jittable functions.

Every function takes `[B, T]` (token level) or `[B]` (sequence level) arrays, works under
`jax.jit`, and treats `mask == 0` positions as absent: they neither contribute to nor
interrupt a recursion, and their outputs are 0. Sign convention: larger advantage = the
action should become more likely.

Conventions pinned by tests/test_advantages.py:
- variances are unbiased (ddof = 1) everywhere (`whiten`, `grpo`);
- `gae` applies gamma once per *policy* token (observation spans are skipped);
- group ids are arbitrary int32 labels (not necessarily 0..G-1); groups are found with
  `jnp.unique(..., size=B)` and reduced with segment sums, so everything stays jittable.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "gae",
    "whiten",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "broadcast",
]


# ---- validation helpers ----
def _check_bt(name: str, x: jax.Array, ref_shape: tuple[int, ...] | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be [B, T], got shape {x.shape}")
    if ref_shape is not None and x.shape != ref_shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {ref_shape}")


def _check_b(name: str, x: jax.Array, ref_shape: tuple[int, ...] | None = None) -> None:
    if x.ndim != 1:
        raise ValueError(f"{name} must be [B], got shape {x.shape}")
    if ref_shape is not None and x.shape != ref_shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {ref_shape}")


# ---- linear recurrences (the engine behind gae / reinforce_pp) ----
def _reverse_linear_scan(a: jax.Array, b: jax.Array, method: str) -> jax.Array:
    """Solve c[t] = a[t] * c[t+1] + b[t] backwards over the last axis, with c[T] = 0.

    a, b: [B, T] float. Returns c: [B, T].
    "scan" runs `lax.scan` over the time-major transpose (each step one vectorised FMA over
    B); "associative" is the parallel prefix form (`lax.associative_scan`, O(log T) depth).
    """
    if method == "associative":
        def combine(left, right):
            # left is the later time step when reverse=True: compose c = a_l*(a_r*c + b_r) + b_l
            a_l, b_l = left
            a_r, b_r = right
            return a_l * a_r, a_r * b_l + b_r

        _, c = jax.lax.associative_scan(combine, (a, b), reverse=True, axis=1)
        return c
    if method != "scan":
        raise ValueError(f"unknown method {method!r}; expected 'scan' or 'associative'")

    def step(carry, ab):  # carry: [B]; ab: ([B], [B])
        a_t, b_t = ab
        carry = a_t * carry + b_t
        return carry, carry

    init = jnp.zeros(a.shape[:1], a.dtype)
    _, c = jax.lax.scan(step, init, (a.T, b.T), reverse=True)  # [T, B]
    return c.T


def _next_policy_value(values: jax.Array, mask: jax.Array, method: str) -> jax.Array:
    """v_next[t] = value at the first policy position strictly after t (0 if none). [B, T]."""
    m = mask.astype(values.dtype)
    # nv[t] = m[t] v[t] + (1 - m[t]) nv[t+1]: the value seen from t looking forward.
    nv = _reverse_linear_scan(1.0 - m, m * values, method)
    return jnp.concatenate([nv[:, 1:], jnp.zeros_like(nv[:, :1])], axis=1)


# ---- GAE ----
# The scan below tells policy tokens from observation tokens by a NaN bit pattern written
# into the rewards (observation rewards are ignored anyway), so it transposes two arrays into
# time-major order instead of three: `python benchmarks/bench_kernels.py` (B=64, T=4096) gave
# ratios to the floor of 3.03-3.24 with the mask as a third input and 2.66-2.94 without it.
# A reward that already carries the pattern is first replaced by an ordinary NaN, so no input
# can pose as an observation token.
_OBSERVATION_BITS = {
    jnp.dtype(jnp.float32): (jnp.uint32, 0x7FC0BAD1),
    jnp.dtype(jnp.float64): (jnp.uint64, 0x7FF800000000BAD1),
}


def _is_observation(x: jax.Array) -> jax.Array:
    """True where x holds the observation bit pattern of its dtype (see above)."""
    uint, bits = _OBSERVATION_BITS[x.dtype]
    return jax.lax.bitcast_convert_type(x, uint) == jnp.asarray(bits, uint)


def _gae_time_major_scan(rewards, values, m, gamma, lam) -> jax.Array:
    """GAE as one fused reverse `lax.scan` over [T, B] (B contiguous: one vector op per step).

    The carry is (value of the next policy token, running advantage); observation tokens
    pass both through. One pass with both carries is cheaper than a next-value scan followed
    by an advantage scan, and unlike an expanded "discounted sum of values" form it never
    accumulates large partial sums (no cancellation at gamma = lam = 1).
    """
    gl = gamma * lam
    uint, bits = _OBSERVATION_BITS[rewards.dtype]
    marker = jax.lax.bitcast_convert_type(jnp.asarray(bits, uint), rewards.dtype)
    policy_rewards = jnp.where(_is_observation(rewards), jnp.nan, rewards)
    coded = jnp.where(m > 0, policy_rewards, marker)  # [B, T]: rewards, marker off-policy

    def step(carry, x):  # carry: ([B], [B]); x: two [B] rows
        next_v, run = carry
        r_t, v_t = x
        policy = jnp.logical_not(_is_observation(r_t))
        run = jnp.where(policy, r_t + gamma * next_v - v_t + gl * run, run)
        next_v = jnp.where(policy, v_t, next_v)
        return (next_v, run), jnp.where(policy, run, 0.0)

    zero = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, adv = jax.lax.scan(step, (zero, zero), (coded.T, values.T), reverse=True)
    return adv.T  # [B, T]


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float,
    lam: float,
    method: str = "scan",
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over policy tokens.

    With policy positions t_1 < ... < t_n of a row (mask == 1) and v(t_{n+1}) = 0:
        delta_k = r(t_k) + gamma * v(t_{k+1}) - v(t_k)
        A(t_k)  = delta_k + gamma * lam * A(t_{k+1})
    i.e. ordinary GAE on the compressed sequence of policy tokens: positions with mask == 0
    pass both the next value and the running advantage through unchanged, and their rewards
    are ignored (the environment reward sits on the last policy token).

    Args:
      rewards: f32 [B, T] per-token rewards.
      values:  f32 [B, T] critic values V(s_t).
      mask:    [B, T] 1 on policy tokens, 0 elsewhere (bool / int / float).
      gamma, lam: discount and GAE lambda (Python floats or scalars).
      method: "scan" (lax.scan over the time-major transpose) or "associative"
        (lax.associative_scan); equal up to float rounding.

    Returns:
      (advantages, returns), both f32 [B, T]: raw (not whitened) advantages and
      returns = advantages + values, both 0 where mask == 0.

    Reference: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
    """
    _check_bt("rewards", rewards)
    _check_bt("values", values, rewards.shape)
    _check_bt("mask", mask, rewards.shape)
    dtype = jnp.result_type(rewards.dtype, values.dtype, jnp.float32)
    rewards, values = rewards.astype(dtype), values.astype(dtype)
    m = mask.astype(dtype)
    if method == "scan":
        adv = _gae_time_major_scan(rewards, values, m, gamma, lam)
    else:
        next_v = _next_policy_value(values, m, method)
        delta = rewards + gamma * next_v - values
        # c[t] = a[t] c[t+1] + b[t]: on policy tokens a = gamma*lam, b = delta; elsewhere
        # a = 1, b = 0 (the carry passes through).
        a = m * (gamma * lam) + (1.0 - m)
        adv = _reverse_linear_scan(a, m * delta, method) * m
    return adv, adv + values * m  # adv is already 0 off-policy


# ---- whitening ----
def whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True) -> jax.Array:
    """Masked whitening over the whole batch.

        mean = sum(m x) / n,  var = sum(m (x - mean)^2) / (n - 1),  n = sum(m)
        x'   = (x - mean) * rsqrt(var + 1e-8)      (+ mean when shift_mean=False)

    Args:
      x: f32 array of any shape ([B, T] or [B]).
      mask: same shape; 1 where x counts.
      shift_mean: False keeps the mean (only the scale is normalised).

    Returns:
      f32 array like x, 0 where mask == 0. With n <= 1 the variance is taken as 0
      (n - 1 is clamped to 1), so a single entry becomes 0 (shift_mean) or keeps its value.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x {x.shape} and mask {mask.shape} must have the same shape")
    m = mask.astype(jnp.result_type(x.dtype, jnp.float32))
    n = m.sum()
    mean = (x * m).sum() / jnp.maximum(n, 1.0)
    var = (jnp.square(x - mean) * m).sum() / jnp.maximum(n - 1.0, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * m


# ---- group (outcome) advantages ----
def _group_stats(scores: jax.Array, group_id: jax.Array):
    """Per-sample group count, mean and unbiased variance. All [B]."""
    _check_b("scores", scores)
    _check_b("group_id", group_id, scores.shape)
    B = scores.shape[0]
    _, seg = jnp.unique(group_id, size=B, fill_value=0, return_inverse=True)
    seg = seg.reshape(B)
    count = jax.ops.segment_sum(jnp.ones_like(scores), seg, num_segments=B)[seg]
    mean = jax.ops.segment_sum(scores, seg, num_segments=B)[seg] / count
    sq = jax.ops.segment_sum(jnp.square(scores - mean), seg, num_segments=B)[seg]
    var = sq / jnp.maximum(count - 1.0, 1.0)
    return seg, count, mean, var


def grpo(
    scores: jax.Array,
    group_id: jax.Array,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """GRPO outcome advantage: (s - mean_g) / (std_g + eps).

    Args:
      scores: f32 [B] episode rewards.
      group_id: int32 [B] group label of each sample (same prompt = same label).
      norm_by_std: False gives Dr.GRPO, s - mean_g.
      eps: added to the std.

    Returns:
      f32 [B]. std is unbiased (n - 1); a group of one sample uses mean 0 and std 1, so its
      advantage is s / (1 + eps) (or s with norm_by_std=False).

    Reference: Shao et al. 2024 (DeepSeekMath); Liu et al. 2025 (Dr.GRPO).
    """
    scores = scores.astype(jnp.result_type(scores.dtype, jnp.float32))
    _, count, mean, var = _group_stats(scores, group_id)
    single = count <= 1.0
    mean = jnp.where(single, 0.0, mean)
    centred = scores - mean
    if not norm_by_std:
        return centred
    std = jnp.where(single, 1.0, jnp.sqrt(var))
    return centred / (std + eps)


def rloo(scores: jax.Array, group_id: jax.Array) -> jax.Array:
    """REINFORCE leave-one-out: s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean_g).

    Args: scores f32 [B]; group_id int32 [B].
    Returns: f32 [B]; a group of one keeps its score s.
    Reference: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE ...".
    """
    scores = scores.astype(jnp.result_type(scores.dtype, jnp.float32))
    _, count, mean, _ = _group_stats(scores, group_id)
    single = count <= 1.0
    scale = count / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(single, scores, scale * (scores - mean))


def grpo_passk(scores: jax.Array, group_id: jax.Array) -> jax.Array:
    """Pass@k-style group advantage: only the best sample of a group is reinforced.

    The best sample (highest score; the lowest index among ties) gets s_best - s_second,
    every other sample 0, so a group improves only through its maximum (pass@k).

    Args: scores f32 [B]; group_id int32 [B].
    Returns: f32 [B]; groups of one get 0 (nothing to compare against).
    Reference: verl's `grpo_passk` outcome advantage (Chen et al. 2025, Pass@k training).
    """
    scores = scores.astype(jnp.result_type(scores.dtype, jnp.float32))
    seg, count, _, _ = _group_stats(scores, group_id)
    B = scores.shape[0]
    idx = jnp.arange(B)
    top1 = jax.ops.segment_max(scores, seg, num_segments=B)[seg]
    first_best = jax.ops.segment_min(jnp.where(scores == top1, idx, B), seg, num_segments=B)[seg]
    is_best = idx == first_best
    top2 = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, scores), seg, num_segments=B)[seg]
    return jnp.where(is_best & (count > 1.0), scores - top2, 0.0)


def broadcast(adv: jax.Array, mask: jax.Array) -> jax.Array:
    """Place a sequence-level advantage on every policy token.

    Args: adv f32 [B]; mask [B, T]. Returns f32 [B, T] = adv[:, None] * mask.
    """
    _check_b("adv", adv)
    _check_bt("mask", mask)
    if mask.shape[0] != adv.shape[0]:
        raise ValueError(f"adv has B={adv.shape[0]} but mask has B={mask.shape[0]}")
    return adv[:, None] * mask.astype(adv.dtype)


# ---- REINFORCE++ ----
def reinforce_pp(
    token_rewards: jax.Array,
    mask: jax.Array,
    *,
    gamma: float,
    method: str = "scan",
) -> jax.Array:
    """REINFORCE++ advantage: whitened discounted return-to-go over policy tokens.

        G(t_k) = r(t_k) + gamma * G(t_{k+1})   over policy positions t_1 < ... < t_n
        A = whiten(G, mask)                      (batch-level, unbiased variance)

    mask == 0 spans carry G through unchanged (gamma applies once per policy token).

    Args: token_rewards f32 [B, T]; mask [B, T]; gamma discount.
    Returns: f32 [B, T], 0 where mask == 0.
    Reference: Hu 2025, "REINFORCE++".
    """
    _check_bt("token_rewards", token_rewards)
    _check_bt("mask", mask, token_rewards.shape)
    dtype = jnp.result_type(token_rewards.dtype, jnp.float32)
    m = mask.astype(dtype)
    a = m * gamma + (1.0 - m)
    ret = _reverse_linear_scan(a, m * token_rewards.astype(dtype), method) * m
    return whiten(ret, m)


def reinforce_pp_baseline(scores: jax.Array, group_id: jax.Array, mask: jax.Array) -> jax.Array:
    """REINFORCE++-baseline: group-mean baseline, broadcast, then batch whitening.

    A = whiten(broadcast(s - mean_g, mask), mask); a group of one uses mean 0.
    Args: scores f32 [B], group_id int32 [B], mask [B, T].
    Returns f32 [B, T], 0 where mask == 0.
    """
    scores = scores.astype(jnp.result_type(scores.dtype, jnp.float32))
    _, count, mean, _ = _group_stats(scores, group_id)
    mean = jnp.where(count <= 1.0, 0.0, mean)  # a group of one has no baseline (as in grpo)
    return whiten(broadcast(scores - mean, mask), mask)
