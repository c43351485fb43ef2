"""HOST: episodes (Python lists of exact token ids) -> a padded `TrainBatch` (DESIGN §3).

This is the only place that pads. A batch is padded to the smallest length bucket that fits
its longest row, and its row count to a multiple of the data-parallel device count, so the
train step compiles once per (rows, bucket) pair instead of once per batch. Padding has every
mask 0, `turn_id == -1` and a group of its own (padding rows never join a real group).

The scalar reward of an episode is placed on its last policy token (`token_rewards`), which
is where GAE and REINFORCE++ read it; group advantages read `reward` / `group_id` per row.
Optional per-turn shaped rewards (`Episode.turn_rewards`, turn index -> reward) land on the
last policy token of their turn and are also added into the row's `reward`, so a row's
`token_rewards` always sum to its `reward`: GAE and REINFORCE++ credit a shaped reward by
position, group advantages (GRPO, RLOO) see it only inside the episode's total.

Packing (`TrajectoryConfig.pack`) puts several short episodes in one row: `attention_mask`
holds segment ids 1, 2, ... (the model attends within a segment only) and `positions` restart
at 0 in every segment. It is meant for token-level losses (SFT); an RL batch keeps one
episode per row because its losses read one reward and one group per row.

Shared prefixes (`TrajectoryConfig.share_prefix_min`) cut a group's common loss-free start
out of its rows into `prefix_tokens`, once per group; a row keeps the prefix's last token, so
its first position's logits predict the first token it owns, and every token with a loss, a
reward or a sampler log-prob stays in the row. A packed forward (`pack_forward`) keeps the rows
whole and adds the same tokens packed for the model. Both layouts: `row_layout.py`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from jaxrl_agent.config import TrajectoryConfig
from jaxrl_agent.row_layout import attach_packing, attach_prefixes, fit_count, pack_rows, shared_prefixes
from jaxrl_agent.structs import TrainBatch

TERMINATIONS = ("submitted", "max_turns", "max_tokens", "parse_error_limit", "sandbox_error", "")


# ---- the episode ----
@dataclass
class Episode:
    """One agent episode as built by `tokenizer.EpisodeBuilder` plus its outcome.

    ids:          exact token ids, prompt + every turn, never re-tokenized.
    loss_mask:    1 on ids the sampler returned (trained on), 0 on rendered text.
    sampler_logp: the sampler's log-prob on sampled ids, 0.0 elsewhere.
    turn_id:      turn index of each id (0 = prompt + first response).
    reward:       scalar outcome (the verifier's reward).
    group_id:     episodes of one prompt share a group (GRPO / RLOO baselines).
    termination:  why the episode ended (one of TERMINATIONS; "" when unknown).
    info:         free-form extras (task id, failures, ...), not sent to the device.
    turn_rewards: optional shaped rewards, turn index -> reward, placed on the last policy
                  token of that turn by `collate` (empty: only the outcome reward).
    """

    ids: list[int]
    loss_mask: list[int]
    sampler_logp: list[float]
    turn_id: list[int]
    reward: float = 0.0
    group_id: int = 0
    termination: str = ""
    info: dict = field(default_factory=dict)
    turn_rewards: dict = field(default_factory=dict)

    @classmethod
    def from_builder(cls, builder, *, reward: float = 0.0, group_id: int = 0, termination: str = "", info=None) -> "Episode":
        """Snapshot a `tokenizer.EpisodeBuilder` (copies its lists)."""
        return cls(list(builder.ids), list(builder.loss_mask), list(builder.sampler_logp), list(builder.turn_id),
                   float(reward), int(group_id), termination, dict(info or {}))

    def __len__(self) -> int:
        return len(self.ids)

    def validate(self) -> None:
        """Raise ValueError when the per-token lists disagree or hold impossible values."""
        n = len(self.ids)
        lens = {"loss_mask": len(self.loss_mask), "sampler_logp": len(self.sampler_logp), "turn_id": len(self.turn_id)}
        if n == 0:
            raise ValueError("empty episode (no token ids)")
        if any(v != n for v in lens.values()):
            raise ValueError(f"episode has {n} ids but per-token lists of lengths {lens}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")
        if self.termination not in TERMINATIONS:
            raise ValueError(f"unknown termination {self.termination!r}; expected one of {TERMINATIONS}")
        if not np.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")
        for k, r in self.turn_rewards.items():
            if not isinstance(k, (int, np.integer)) or not math.isfinite(r):
                raise ValueError(f"turn_rewards must map int turns to finite rewards, got {k!r}: {r!r}")

    # ---- JSON (one line of an episode file, `save_episodes`; half a preference pair) ----
    def to_dict(self) -> dict:
        """A JSON-able dict; `from_dict` reads it back."""
        return {"ids": list(self.ids), "loss_mask": list(self.loss_mask), "sampler_logp": list(self.sampler_logp),
                "turn_id": list(self.turn_id), "reward": self.reward, "group_id": self.group_id,
                "termination": self.termination, "info": self.info,
                "turn_rewards": {str(k): v for k, v in self.turn_rewards.items()}}

    @classmethod
    def from_dict(cls, d, where: str = "episode") -> "Episode":
        """An Episode from a dict: `ids` and `loss_mask` are required; `sampler_logp` (0),
        `turn_id` (0), `reward`, `group_id`, `termination`, `info`, `turn_rewards` optional.
        Raises ValueError naming `where` (e.g. "pairs.jsonl:3 chosen") and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: an episode must be a JSON object, got {type(d).__name__}")
        for key in ("ids", "loss_mask"):
            if not isinstance(d.get(key), list):
                raise ValueError(f"{where}: field {key!r} must be a list of integers")
        n = len(d["ids"])
        try:
            ep = cls(ids=[int(i) for i in d["ids"]], loss_mask=[int(m) for m in d["loss_mask"]],
                     sampler_logp=[float(x) for x in d.get("sampler_logp", [0.0] * n)],
                     turn_id=[int(x) for x in d.get("turn_id", [0] * n)], reward=float(d.get("reward", 0.0)),
                     group_id=int(d.get("group_id", 0)), termination=str(d.get("termination", "")),
                     info=dict(d.get("info", {})),
                     turn_rewards={int(k): float(v) for k, v in d.get("turn_rewards", {}).items()})
            ep.validate()
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: {e}") from None
        return ep


# ---- JSONL: the one episode file format (demonstrations, logged episodes; pairs hold two) ----
def save_episodes(path: str, episodes: Sequence[Episode], append: bool = False) -> None:
    """Write `episodes` as JSONL, one `Episode.to_dict()` per line; `load_episodes` reads it.
    An `info` value JSON cannot hold is written as its `str` (info is a record, not an input)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for e in episodes:
            f.write(json.dumps(e.to_dict(), default=str) + "\n")


def load_episodes(path: str) -> list[Episode]:
    """Episodes from a JSONL file of `Episode.to_dict()` lines (the optional fields default as
    in `Episode.from_dict`); blank lines are skipped. A bad line raises ValueError naming the
    file, the line number and the field."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            out.append(Episode.from_dict(record, f"{path}:{lineno}"))
    return out


@dataclass(frozen=True)
class CollateInfo:
    """What `collate` did besides padding.

    rows:      index of the episode(s) in each batch row (packed rows hold several; padding
               rows hold none).
    truncated: episode index -> reason, for every episode cut at the largest bucket.
    length:    the bucket T the batch was padded to.
    """

    rows: tuple[tuple[int, ...], ...]
    truncated: dict
    length: int


# ---- helpers ----
def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises ValueError when n exceeds every bucket."""
    fit = [b for b in sorted(buckets) if b >= n]
    if not fit:
        raise ValueError(f"length {n} exceeds the largest bucket {max(buckets)}")
    return fit[0]


def _fit(episodes: Sequence[Episode], cfg: TrajectoryConfig) -> tuple[list[Episode], dict]:
    """Validate, and truncate or reject episodes longer than the largest bucket."""
    if not cfg.buckets or min(cfg.buckets) < 1:
        raise ValueError(f"TrajectoryConfig.buckets must be positive lengths, got {cfg.buckets}")
    if cfg.overflow not in ("error", "truncate"):
        raise ValueError(f"TrajectoryConfig.overflow must be 'error' or 'truncate', got {cfg.overflow!r}")
    limit, out, truncated = max(cfg.buckets), [], {}
    for i, ep in enumerate(episodes):
        ep.validate()
        if len(ep) > limit:
            if cfg.overflow == "error":
                raise ValueError(f"episode {i} has {len(ep)} tokens, more than the largest bucket {limit} "
                                 f"(set overflow='truncate' or add a bucket)")
            truncated[i] = f"truncated from {len(ep)} to {limit} tokens (largest bucket)"
            ep = replace(ep, ids=ep.ids[:limit], loss_mask=ep.loss_mask[:limit], sampler_logp=ep.sampler_logp[:limit],
                         turn_id=ep.turn_id[:limit], info={**ep.info, "truncated": truncated[i]})
        out.append(ep)
    return out, truncated


def _place_turn_rewards(ep: Episode, row: np.ndarray) -> float:
    """Add each shaped reward onto the last policy token of its turn (in place on `row`, the
    episode's slice of token_rewards); returns their sum. A turn without a policy token
    (cut by truncation) has nowhere to go: its reward is dropped, from the row's total too."""
    mask, turns = np.asarray(ep.loss_mask) > 0, np.asarray(ep.turn_id)
    placed = 0.0
    for turn, r in sorted(ep.turn_rewards.items()):
        idx = np.flatnonzero(mask & (turns == turn))
        if idx.size:
            row[idx[-1]] += r
            placed += r
    return placed


# ---- collate ----
def collate(episodes: Sequence[Episode], cfg: TrajectoryConfig = TrajectoryConfig()) -> tuple[TrainBatch, CollateInfo]:
    """Pad (or pack) episodes into a `TrainBatch` of NumPy arrays.

    Args:
      episodes: at least one `Episode`.
      cfg: buckets, row multiple, overflow policy, packing, pad id.
    Returns:
      (batch, info): batch fields `[B, T]` (`group_id`, `reward` `[B]`) with T a bucket and B
      a multiple of `cfg.batch_multiple`; `ref_logp`, `old_logp`, `old_values` and
      `advantages` are None (the train step fills what it needs). `info` maps rows back to
      episodes and records truncations.
    Raises:
      ValueError on an empty list, an inconsistent episode, an overflow under
      `overflow="error"`, or packing episodes that carry rewards.
    """
    if not episodes:
        raise ValueError("collate needs at least one episode")
    if cfg.batch_multiple < 1:
        raise ValueError(f"batch_multiple must be >= 1, got {cfg.batch_multiple}")
    if cfg.pack_forward and (cfg.pack or cfg.share_prefix_min):
        raise ValueError("TrajectoryConfig.pack_forward packs the rows for the model only: it cannot be combined "
                         "with pack (rows that are themselves packed) or share_prefix_min (set it to 0)")
    eps, truncated = _fit(episodes, cfg)
    prefix_of, cuts, prefixes = [-1] * len(eps), [0] * len(eps), []
    if cfg.share_prefix_min and not cfg.pack:  # a packed row holds several episodes
        prefix_of, cuts, prefixes = shared_prefixes(eps, cfg.share_prefix_min, max(cfg.prefix_buckets or cfg.buckets))
    if cfg.pack:
        if any(ep.reward != 0.0 or ep.turn_rewards for ep in eps):
            raise ValueError("packing is for token-level losses (SFT): RL episodes carry rewards and need one "
                             "episode per row (set TrajectoryConfig.pack=False; pack_forward packs RL rows "
                             "for the model only)")
        rows = pack_rows([len(ep) for ep in eps], max(cfg.buckets))
        longest = max(sum(len(eps[i]) for i in row) for row in rows)
    else:
        rows = [[i] for i in range(len(eps))]
        longest = max(len(ep) - cut for ep, cut in zip(eps, cuts))
    T = bucket_length(longest, cfg.buckets)
    B = fit_count(len(rows), cfg.row_buckets, cfg.batch_multiple, "row_buckets")

    tokens = np.full((B, T), cfg.pad_id, np.int32)
    positions = np.zeros((B, T), np.int32)
    attention_mask = np.zeros((B, T), np.int32)
    loss_mask = np.zeros((B, T), np.int32)
    sampler_logp = np.zeros((B, T), np.float32)
    turn_id = np.full((B, T), -1, np.int32)
    token_rewards = np.zeros((B, T), np.float32)
    reward = np.zeros((B,), np.float32)
    # Padding rows get group ids below every real one, each its own group of one.
    group_id = np.asarray([-(b + 1) for b in range(B)], np.int32) + min(0, min(ep.group_id for ep in eps))

    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, start=1):
            ep, cut = eps[i], cuts[i]  # a shared prefix's tokens [0, cut) are in prefix_tokens
            n = len(ep) - cut
            sl = slice(start, start + n)
            tokens[r, sl] = ep.ids[cut:]
            positions[r, sl] = np.arange(cut, len(ep))
            attention_mask[r, sl] = seg  # 1 for an unpacked row
            loss_mask[r, sl] = ep.loss_mask[cut:]
            sampler_logp[r, sl] = (np.asarray(ep.sampler_logp, np.float32) * np.asarray(ep.loss_mask, np.float32))[cut:]
            turn_id[r, sl] = ep.turn_id[cut:]
            rewards = np.zeros(len(ep), np.float32)
            policy = np.flatnonzero(np.asarray(ep.loss_mask))
            if policy.size:  # the outcome lands on the last token the policy chose
                rewards[policy[-1]] = ep.reward
            shaped = _place_turn_rewards(ep, rewards) if ep.turn_rewards else 0.0
            token_rewards[r, sl] = rewards[cut:]  # all on policy tokens, which no prefix holds
            start += n
        reward[r] = eps[row[0]].reward + shaped  # packed rows carry no rewards (checked above)
        group_id[r] = eps[row[0]].group_id
    batch = TrainBatch(tokens=tokens, positions=positions, attention_mask=attention_mask, loss_mask=loss_mask,
                       sampler_logp=sampler_logp, turn_id=turn_id, token_rewards=token_rewards,
                       group_id=group_id, reward=reward)
    if prefixes:  # a batch where no group shares a prefix is padded whole, without prefix leaves
        tp = bucket_length(max(len(p) for p in prefixes), cfg.prefix_buckets or cfg.buckets)
        batch = attach_prefixes(batch, [prefix_of[row[0]] for row in rows], prefixes, tp, cfg)
    if cfg.pack_forward:
        batch = attach_packing(batch, cfg)
    info = CollateInfo(rows=tuple(tuple(r) for r in rows) + ((),) * (B - len(rows)), truncated=truncated, length=T)
    return batch, info


def shape_episodes(cfg: TrajectoryConfig) -> list[Episode]:
    """Episodes whose batch, collated under `cfg` to one length bucket (`buckets=(T,)`), has a
    grouped rollout batch's tree and shapes, for `TrainStep.precompile`: with prefix sharing
    on, a group of two sharing a prompt that fits the smallest prefix bucket (P from
    `prefix_rows`); a longer prompt's batch compiles when it first comes."""
    if not cfg.share_prefix_min or cfg.pack:
        return [Episode([cfg.pad_id], [0], [0.0], [0])]
    n = cfg.share_prefix_min + 2  # a prefix of share_prefix_min + 1 tokens, then one kept and one sampled
    return [Episode([cfg.pad_id] * n, [0] * (n - 1) + [1], [0.0] * n, [0] * n, group_id=0) for _ in range(2)]


def preference_pairs(pairs: Sequence[tuple[Episode, Episode]], cfg: TrajectoryConfig = TrajectoryConfig()) -> TrainBatch:
    """DPO batch: rows 2i (chosen) and 2i+1 (rejected), the layout the "dpo" LossFn expects.

    Each pair gets its own group id i. Packing is refused (a pair must stay two rows), and
    the row count is padded with empty *pairs*, so `batch_multiple` must be even.
    """
    if not pairs:
        raise ValueError("preference_pairs needs at least one (chosen, rejected) pair")
    if cfg.pack:
        raise ValueError("DPO rows cannot be packed (rows 2i / 2i+1 form a pair)")
    if cfg.batch_multiple % 2 and cfg.batch_multiple != 1:
        raise ValueError(f"batch_multiple must be even (or 1) for pairs, got {cfg.batch_multiple}")
    if any(r % 2 for r in cfg.row_buckets):
        raise ValueError(f"row_buckets must be even for pairs, got {cfg.row_buckets}")
    flat = []
    for i, (chosen, rejected) in enumerate(pairs):
        for ep in (chosen, rejected):
            flat.append(Episode(ep.ids, ep.loss_mask, ep.sampler_logp, ep.turn_id, 0.0, i, ep.termination, ep.info))
    multiple = cfg.batch_multiple if cfg.batch_multiple % 2 == 0 else 2
    batch, _ = collate(flat, replace(cfg, batch_multiple=multiple))
    return batch
