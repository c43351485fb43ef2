"""Plain NumPy loop references for the kernels of advantages.py and losses/.

Written the slow, obvious way (Python loops over rows, groups and time) so they are easy to
check by eye; the JAX kernels are tested against these.
"""
from __future__ import annotations

import numpy as np


# ---- advantages ----
def gae(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = np.zeros((B, T), np.float64)
    for b in range(B):
        next_v, running = 0.0, 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                continue
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_v = values[b, t]
    ret = np.where(mask > 0, adv + values, 0.0)
    return adv, ret


def whiten(x, mask, shift_mean=True):
    sel = x[mask > 0].astype(np.float64)
    n = sel.size
    mean = sel.mean() if n else 0.0
    var = ((sel - mean) ** 2).sum() / max(n - 1, 1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return np.where(mask > 0, out, 0.0)


def _groups(group_id):
    groups = {}
    for i, g in enumerate(group_id.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def grpo(scores, group_id, norm_by_std=True, eps=1e-6):
    out = np.zeros(len(scores), np.float64)
    for idx in _groups(group_id).values():
        s = scores[idx].astype(np.float64)
        if len(idx) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = s.mean(), s.std(ddof=1)
        out[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return out


def rloo(scores, group_id):
    out = np.zeros(len(scores), np.float64)
    for idx in _groups(group_id).values():
        for i in idx:
            others = [scores[j] for j in idx if j != i]
            out[i] = scores[i] - np.mean(others) if others else scores[i]
    return out


def grpo_passk(scores, group_id):
    out = np.zeros(len(scores), np.float64)
    for idx in _groups(group_id).values():
        if len(idx) < 2:
            continue
        best = max(idx, key=lambda i: (scores[i], -i))
        second = max(scores[j] for j in idx if j != best)
        out[best] = scores[best] - second
    return out


def reinforce_pp(token_rewards, mask, gamma):
    B, T = token_rewards.shape
    ret = np.zeros((B, T), np.float64)
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                running = token_rewards[b, t] + gamma * running
                ret[b, t] = running
    return whiten(ret, mask)


def reinforce_pp_baseline(scores, group_id, mask):
    centred = np.zeros(len(scores), np.float64)
    for idx in _groups(group_id).values():
        mean = scores[idx].mean() if len(idx) > 1 else 0.0
        centred[idx] = scores[idx] - mean
    return whiten(centred[:, None] * mask, mask)


# ---- losses ----
def aggregate(x, mask, mode, horizon=None):
    B, T = x.shape
    horizon = T if horizon is None else horizon
    if mode == "token-mean":
        return (x * mask).sum() / max(mask.sum(), 1)
    per_seq = []
    for b in range(B):
        n = mask[b].sum()
        if n == 0:
            continue
        s = (x[b] * mask[b]).sum()
        if mode == "seq-mean-token-sum":
            per_seq.append(s)
        elif mode == "seq-mean-token-mean":
            per_seq.append(s / n)
        elif mode == "seq-mean-token-sum-norm":
            per_seq.append(s / horizon)
        else:
            raise ValueError(mode)
    return float(np.mean(per_seq)) if per_seq else 0.0


def kl_penalty(logp, ref, kind):
    d = logp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d**2
    if kind in ("k3", "low_var_kl"):
        r = np.clip(ref - logp, -20, 20)
        return np.clip(np.exp(r) - r - 1, -10, 10)
    raise ValueError(kind)


def ppo_per_token(logp, old_logp, adv, clip_low, clip_high, dual_clip):
    B, T = logp.shape
    out = np.zeros((B, T), np.float64)
    for b in range(B):
        for t in range(T):
            ratio = np.exp(np.clip(logp[b, t] - old_logp[b, t], -20, 20))
            a = adv[b, t]
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss = max(l1, l2)
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            out[b, t] = loss
    return out
