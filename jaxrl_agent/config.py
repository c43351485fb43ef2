"""Frozen dataclass configs: one docstring per field, no logic.

Each function receives only the sub-config it needs (DESIGN §10). CLI overrides address
fields with dotted names, e.g. `--loss.clip_high=0.28`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossConfig:
    """Everything a registered `LossFn` may read. Unused fields are ignored by a loss."""

    agg: str = "token-mean"
    """Loss aggregation mode (see `losses.aggregate`)."""
    clip_low: float = 0.2
    """PPO lower clip: ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO upper clip: ratio is clipped at 1 + clip_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c for negative advantages (None disables it)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap for exp(old_logp - sampler_logp); None disables TIS."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (0 disables it; needs `ref_logp`)."""
    kl_kind: str = "k3"
    """KL estimator for the loss term: k1/kl, abs, k2/mse, k3/low_var_kl."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    vf_coef: float = 0.5
    """Weight of the value loss (only when the policy has a value head)."""
    cliprange_value: float | None = 0.2
    """Value clipping range around `old_values` (None disables value clipping)."""
    gamma: float = 1.0
    """Discount per policy token (GAE, REINFORCE++)."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten token-level advantages over the batch (PPO with GAE)."""
    norm_by_std: bool = True
    """GRPO: divide by the group std (False is Dr.GRPO)."""
    gspo_clip_low: float = 3e-4
    """GSPO lower clip of the sequence-level ratio."""
    gspo_clip_high: float = 4e-4
    """GSPO upper clip of the sequence-level ratio."""
    cispo_clip_high: float = 5.0
    """CISPO upper clip of the (stop-gradient) IS weight; CISPO uses no lower clip by default."""
    cispo_clip_low: float | None = None
    """CISPO lower clip of the IS weight (None: no lower clip)."""
    dpo_beta: float = 0.1
    """DPO inverse temperature beta."""
    dpo_kind: str = "sigmoid"
    """DPO variant: "sigmoid" (DPO) or "ipo"."""
    dpo_label_smoothing: float = 0.0
    """Conservative DPO label smoothing epsilon (sigmoid kind only)."""


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling engine (`sampling.py`, `sampling_engine.py`). Hashable: the jitted decode
    loop takes it as a static argument, so changing a field compiles a new loop."""

    temperature: float = 1.0
    """Softmax temperature of the sampling distribution; 0.0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling (0 disables top-k)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (after top-k)."""
    max_new_tokens: int = 256
    """Most tokens sampled per turn (also the static length of the decode output buffer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Default per-row stop set (e.g. <|im_end|>, </tool_call>); a sampled stop token ends the turn and is kept."""
    max_stop_tokens: int = 4
    """Width of the per-row stop-token table (a row's stop set may hold at most this many ids)."""
    batch_size: int = 8
    """Rows of the engine: independent episodes sampled together."""
    cache_size: int = 2048
    """S, KV-cache slots per row: the longest episode (prompt + all turns) a row can hold."""
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    """Allowed prefill chunk lengths; a chunk is padded up to the smallest bucket that fits."""
    seed: int = 0
    """Base PRNG seed; a row's stream is also keyed by its episode seed and token position."""
