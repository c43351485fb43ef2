"""HOST: the RL loop's work split across the processes of a `jax.distributed` job, and the few
values that must be global.

    process p of P:   tasks[lo_p:hi_p]                    (contiguous, whole groups: `Processes.share`)
                        | collect_episodes(seed + lo_p * G, first_group_id = lo_p)
                        v
                      local episodes ----collate (agreed T, B / P rows)----> local rows
                        |                                                      | sharding.shard_local_batch
                        | light copies (no token ids)                          v
                        v                                               the global batch (rows of
                      allgather -> every process: all episodes'           process p on p's devices;
                      rewards and infos (metrics, eval, reward stats)     no host holds it whole)

Episode k of task i gets the seed `seed + i * G + k` and group id `first_group_id + i` wherever
it runs, so P processes sample exactly the episodes one process would, and the global batch
holds them in the same row order (process 0's rows first). Groups never straddle processes,
so group advantages need no exchange; what does (reward statistics, the shuffled-reward
control's permutation, logged means, evaluation) reads the all-gathered light copies.

One process (`is_main`, index 0) writes metrics and the exported policy; checkpoints are
written by all of them together (orbax), and every process resumes from them. On one process
every function here is the identity and nothing is communicated.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Any, Sequence

import jax
import numpy as np


@dataclass(frozen=True)
class Processes:
    """This process's place in the job (`jax.process_index()` of `jax.process_count()`)."""

    index: int = 0
    count: int = 1

    @classmethod
    def current(cls) -> "Processes":
        return cls(jax.process_index(), jax.process_count())

    @property
    def is_main(self) -> bool:
        return self.index == 0

    def share(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this process's items among `n` (contiguous; sizes differ by at most 1)."""
        lo = self.index * n // self.count
        return lo, (self.index + 1) * n // self.count

    def allgather(self, obj: Any) -> list:
        """`obj` of every process, in process order (pickled over a JAX all-gather).

        Only for values this job's own processes produce (pickle trusts its input): counts,
        rewards, episode infos. On one process: `[obj]`.
        """
        if self.count == 1:
            return [obj]
        from jax.experimental import multihost_utils

        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
        width = 1 << max(8, int(sizes.max() - 1).bit_length())  # power-of-two widths: few compiles
        buf = np.zeros(width, np.uint8)
        buf[: data.size] = data
        every = np.asarray(multihost_utils.process_allgather(buf)).reshape(self.count, width)
        return [pickle.loads(every[p, : sizes[p]].tobytes()) for p in range(self.count)]

    def concat(self, items: Sequence) -> list:
        """The concatenation of every process's `items`, in process order."""
        return [x for part in self.allgather(list(items)) for x in part]

    def sum(self, value):
        """Sum over processes of a number, or of a flat dict of numbers (keys of all)."""
        parts = self.allgather(value)
        if isinstance(value, dict):
            return {k: sum(p.get(k, 0) for p in parts) for k in sorted({k for p in parts for k in p})}
        return sum(parts)

    def max(self, value):
        return max(self.allgather(value))


def light(episode):
    """`episode` without its token arrays: what global metrics and evaluation read."""
    return replace(episode, ids=[], loss_mask=[], sampler_logp=[], turn_id=[])


def merge_stats(parts: Sequence[dict]) -> dict:
    """Rollout cost of all processes (`RolloutStats.as_dict()` each): seconds are the slowest
    process's (they ran at the same time), counts are summed, throughput is recomputed."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {k: max(p[k] for p in parts) for k in parts[0] if k.startswith("seconds_")}
    for k in ("tokens_sampled", "tokens_total", "episodes", "engine_calls"):
        out[k] = sum(p.get(k, 0) for p in parts)
    terms: dict[str, int] = {}
    for p in parts:
        for k, v in p["terminations"].items():
            terms[k] = terms.get(k, 0) + v
    out["terminations"] = terms
    out["sampled_tokens_per_s"] = out["tokens_sampled"] / max(out["seconds_sampling"], 1e-9)
    return out
