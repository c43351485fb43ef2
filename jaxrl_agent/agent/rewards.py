"""HOST: what the RL loop trains on: reward composition, normalisation and per-turn shaping.

    episodes (reward = the verifier's 0/1) --RewardComposer(RewardConfig, reward model)-->
      verifier  v_i                       the independent judge (DESIGN §7)
      reward model s_i                    a frozen scorer, `reward_model.RewardModel.score`
      s'_i = clip(normalise(s_i))         optional running mean / std and clipping
      total_i = v_i | w_rm s'_i | w_v v_i + w_rm s'_i       (RewardConfig.source)
      turn_rewards_i = {turn: penalty}    optional shaping from what each turn did
    -> copies of the episodes with reward = total_i and turn_rewards set; the components go to
       `info["reward_components"]` and, averaged, to the loop's metrics.

The episodes the rollout returns keep the verifier's reward (success rates, pass@k and the
held-out evaluation always read the verifier); only the copies that enter the update carry
the composed reward. `trajectory.collate` places the total on the last policy token and each
turn's shaped reward on the last policy token of that turn.

Per-turn shaping reads `info["turn_outcomes"]` (one label per assistant turn, written by the
rollout from the tool session's history, see `turn_outcomes`), so composing needs no access to
the tool session.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from jaxrl_agent.config import RewardConfig
from jaxrl_agent.env.tool_calls import EDIT_TOOLS
from jaxrl_agent.trajectory import Episode

SOURCES = ("verifier", "reward_model", "sum")
TURN_OUTCOMES = ("ok", "interface_error", "tool_error", "repeated_test", "unchanged_edit")


# ---- per-turn outcomes and shaping ----
def turn_outcomes(history: Sequence) -> list[str]:
    """One label per assistant turn of a `ToolSession.history` of (text, StepResult):

    "interface_error"  the call never reached a tool (parse error, unknown tool, bad arguments);
    "tool_error"       a legal call the tool could not carry out (missing file, `old` not found);
    "repeated_test"    `run_tests` with no edit that changed a file since the previous
                       `run_tests`: the workspace is unchanged, so the result cannot be new;
    "unchanged_edit"   an edit carried out that changed nothing (`StepResult.changed` False:
                       the lines already held its text, e.g. a correct line rewritten in a loop);
    "ok"               anything else.
    Turn k of the list is turn k of the episode (`Episode.turn_id`)."""
    out, tested_since_edit = [], False
    for _, step in history:
        if step.error is not None:
            out.append("interface_error")
            continue
        name = step.call.name
        unchanged = name in EDIT_TOOLS and step.tool_ok and step.changed is False
        if not step.tool_ok:
            out.append("tool_error")
        elif name == "run_tests" and tested_since_edit:
            out.append("repeated_test")
        else:
            out.append("unchanged_edit" if unchanged else "ok")
        if name == "run_tests":
            tested_since_edit = True
        elif name in EDIT_TOOLS and step.tool_ok and not unchanged:
            tested_since_edit = False
    return out


def shaped_turn_rewards(outcomes: Sequence[str], cfg: RewardConfig) -> dict[int, float]:
    """Turn index -> shaped reward from the per-turn outcome labels (zeros left out)."""
    table = {"ok": 0.0, "interface_error": cfg.interface_error_penalty, "tool_error": cfg.tool_error_penalty,
             "repeated_test": cfg.repeated_test_penalty, "unchanged_edit": cfg.unchanged_edit_penalty}
    out = {}
    for k, o in enumerate(outcomes):
        if o not in table:
            raise ValueError(f"unknown turn outcome {o!r} at turn {k}; expected one of {TURN_OUTCOMES}")
        if table[o]:
            out[k] = float(table[o])
    return out


def shaping_enabled(cfg: RewardConfig) -> bool:
    return any((cfg.interface_error_penalty, cfg.tool_error_penalty, cfg.repeated_test_penalty,
                cfg.unchanged_edit_penalty))


# ---- running normalisation ----
class RunningMeanStd:
    """Mean and (population) variance of every value seen so far, merged batch by batch with
    Chan et al.'s parallel update, so the result equals the statistics of all values at once."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64).ravel()
        if x.size == 0:
            return
        n, mean = x.size, float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def normalize(self, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        """(x - mean) / (std + eps) with the current statistics."""
        return (np.asarray(x, np.float64) - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, d: dict) -> None:
        self.count, self.mean, self.m2 = int(d["count"]), float(d["mean"]), float(d["m2"])


# ---- composition ----
class RewardComposer:
    """Turns rollout episodes into training episodes under a `RewardConfig`.

    Args:
      cfg: the RewardConfig.
      reward_model: anything with `.score(episodes) -> np.ndarray [N]` (a frozen
        `reward_model.RewardModel`); required unless `cfg.source == "verifier"`.
      gather: on a multi-process job, maps this process's `[n]` array to the `[N]` array of
        every process's episodes (`multihost.Processes`), so the reward model's running
        statistics and the metrics are the whole batch's; None: one process.
    Call it on a list of episodes: returns (episodes with the composed `reward` and
    `turn_rewards`, metrics of each component averaged over the episodes).
    """

    def __init__(self, cfg: RewardConfig, reward_model=None, gather=None):
        if cfg.source not in SOURCES:
            raise ValueError(f"unknown reward source {cfg.source!r}; expected one of {SOURCES}")
        if cfg.source != "verifier" and reward_model is None:
            raise ValueError(f"reward source {cfg.source!r} needs a reward model (set rewards.reward_model_path "
                             "to a directory written by `python -m jaxrl_agent rm-train`)")
        if cfg.clip is not None and cfg.clip <= 0:
            raise ValueError(f"rewards.clip must be positive or None, got {cfg.clip}")
        self.cfg, self.reward_model = cfg, reward_model
        self.gather = gather or (lambda x: x)
        self.stats = RunningMeanStd()

    @property
    def uses_reward_model(self) -> bool:
        return self.cfg.source != "verifier"

    def __call__(self, episodes: Sequence[Episode]) -> tuple[list[Episode], dict]:
        cfg = self.cfg
        verifier = np.array([e.reward for e in episodes], np.float64)  # [n], this process's
        total = verifier.copy()
        rm_raw = rm_used = None
        if self.uses_reward_model:
            rm_raw = np.asarray(self.reward_model.score(episodes), np.float64) if episodes else np.zeros(0)
            rm_used = rm_raw
            if cfg.normalize:
                self.stats.update(self.gather(rm_raw))  # the whole batch; it counts: the first is standardised too
                rm_used = self.stats.normalize(rm_raw)
            if cfg.clip is not None:
                rm_used = np.clip(rm_used, -cfg.clip, cfg.clip)
            if cfg.source == "reward_model":
                total = cfg.reward_model_weight * rm_used
            else:
                total = cfg.verifier_weight * verifier + cfg.reward_model_weight * rm_used
        out, shaping = [], []
        for i, e in enumerate(episodes):
            turns = shaped_turn_rewards(e.info.get("turn_outcomes", []), cfg) if shaping_enabled(cfg) else {}
            shaping.append(sum(turns.values()))
            comps = {"verifier": float(verifier[i]), "shaping": shaping[-1], "total": float(total[i])}
            if rm_raw is not None:
                comps.update(reward_model=float(rm_raw[i]), reward_model_used=float(rm_used[i]))
            out.append(replace(e, reward=float(total[i]), turn_rewards=turns,
                               info={**e.info, "reward_components": comps}))
        # the metrics are the whole batch's: one gather of every per-episode column [N, 3 or 5]
        cols = [verifier, total, np.asarray(shaping, np.float64)] + ([rm_raw, rm_used] if rm_raw is not None else [])
        every = self.gather(np.stack(cols, axis=1).reshape(len(episodes), len(cols)))
        if not len(every):
            return [], {}
        metrics = {"verifier_mean": float(every[:, 0].mean()), "shaping_mean": float(every[:, 2].mean()),
                   # what the update sees per episode: the outcome total plus every shaped turn reward
                   "total_mean": float((every[:, 1] + every[:, 2]).mean())}
        if rm_raw is not None:
            raw, used = every[:, 3], every[:, 4]
            metrics.update(reward_model_mean=float(raw.mean()), reward_model_std=float(raw.std()),
                           reward_model_used_mean=float(used.mean()),
                           reward_model_verifier_corr=_corr(raw, every[:, 0]))
        return out, metrics


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation; 0 when either side is constant (no linear relation measurable)."""
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])
