"""HOST: preference pairs of episodes, for DPO and the reward model.

    pair_batch             pairs -> one TrainBatch (rows 2i chosen / 2i+1 rejected)
    pairs_from_groups      two episodes of one task whose verifier rewards differ
    save / load_preference_pairs   JSONL, a bad line named by file and line number
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Sequence

import numpy as np

from jaxrl_agent.config import TrajectoryConfig
from jaxrl_agent.structs import TrainBatch
from jaxrl_agent.trajectory import Episode, preference_pairs

Pair = tuple[Episode, Episode]  # (chosen, rejected)


class PreferenceDataError(ValueError):
    """Preference data that cannot train a reward model: a malformed JSONL line (the message
    names the file, line and field), too few pairs."""


# ---- pairs ----
def pair_batch(pairs: Sequence[Pair], cfg: TrajectoryConfig = TrajectoryConfig()) -> TrainBatch:
    """Bradley-Terry batch: rows 2i (chosen) / 2i+1 (rejected), as `trajectory.preference_pairs`.

    Every episode gets one padding token appended (loss_mask 0): `PolicyOutputs.values[:, t]`
    is the head read at position t - 1, so the head at the last policy token l is
    `values[:, l + 1]`, which must exist even when l ends the episode (size the largest bucket
    one above the longest episode). `old_values` is filled with zeros so the train step does
    not spend a forward on critic values the loss never reads.
    """
    bad = [i for i, (c, r) in enumerate(pairs) if not any(c.loss_mask) or not any(r.loss_mask)]
    if bad:
        raise ValueError(f"pairs {bad[:5]} have a side without policy (loss_mask == 1) tokens: nothing to score")

    def slot(ep: Episode) -> Episode:
        return replace(ep, ids=[*ep.ids, cfg.pad_id], loss_mask=[*ep.loss_mask, 0],
                       sampler_logp=[*ep.sampler_logp, 0.0], turn_id=[*ep.turn_id, ep.turn_id[-1]],
                       reward=0.0, turn_rewards={})

    batch = preference_pairs([(slot(c), slot(r)) for c, r in pairs], cfg)
    return batch.replace(old_values=np.zeros_like(batch.sampler_logp))


def pairs_from_groups(episodes: Sequence[Episode], max_pairs_per_group: int = 4, seed: int = 0) -> list[Pair]:
    """Preference pairs from the loop: inside each group (one task), every two episodes whose
    verifier rewards differ, the higher one chosen; at most `max_pairs_per_group` per group,
    drawn without replacement with a seeded RNG. Sandbox errors (unknown outcome) are skipped."""
    groups: dict[tuple, list[Episode]] = {}
    for e in episodes:
        if e.termination != "sandbox_error":
            groups.setdefault((e.group_id, e.info.get("task_id", "")), []).append(e)
    rng = np.random.default_rng(seed)
    out: list[Pair] = []
    for key in sorted(groups, key=str):
        g = groups[key]
        cands = [(a, b) for a in g for b in g if a.reward > b.reward]
        for k in rng.permutation(len(cands))[:max_pairs_per_group]:
            out.append(cands[int(k)])
    return out


def save_preference_pairs(path: str, pairs: Sequence[Pair], append: bool = False) -> None:
    """Write pairs as JSONL lines {"chosen": episode, "rejected": episode}."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for c, r in pairs:
            f.write(json.dumps({"chosen": c.to_dict(), "rejected": r.to_dict()}) + "\n")


def load_preference_pairs(path: str) -> list[Pair]:
    """Read preference pairs from JSONL, one per line, in either form:
        {"chosen": EPISODE, "rejected": EPISODE}
        {"a": EPISODE, "b": EPISODE, "label": 0 | 1}      (label: index of the preferred one)
    EPISODE is `Episode.to_dict()`'s form (`ids` and `loss_mask` required). Blank lines are
    skipped; a malformed line raises PreferenceDataError naming the file, the line number and the field.
    """
    pairs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceDataError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PreferenceDataError(f"{where}: a pair must be a JSON object")
            if "chosen" in rec or "rejected" in rec:
                keys = ("chosen", "rejected")
            elif "label" in rec:
                if rec["label"] not in (0, 1) or isinstance(rec["label"], bool):
                    raise PreferenceDataError(f"{where}: field 'label' must be 0 (a preferred) or 1 (b preferred), "
                                     f"got {rec['label']!r}")
                keys = ("a", "b") if rec["label"] == 0 else ("b", "a")
            else:
                raise PreferenceDataError(f"{where}: expected fields 'chosen' and 'rejected', or 'a', 'b' and 'label'")
            for k in keys:
                if k not in rec:
                    raise PreferenceDataError(f"{where}: missing field {k!r}")
            try:
                chosen, rejected = (Episode.from_dict(rec[k], f"{where} field {k!r}") for k in keys)
            except ValueError as e:
                raise PreferenceDataError(str(e)) from None
            pairs.append((chosen, rejected))
    if not pairs:
        raise PreferenceDataError(f"{path}: no preference pairs")
    return pairs
