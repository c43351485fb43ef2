"""HOST: the one place a sampling engine's config is derived and checked.

    agent_sampling(**overrides)            the agent jobs' engine shape (whole episodes of up to
                                           1024 tokens; turns of up to 96)
    episode_engine(tokenizer, rollout)     + the rules an episode engine must obey:
      stop_token_ids  = the tokenizer's stop ids (<|im_end|>, end of text)
      cache_size      = the rollout's token budget (`RolloutConfig.max_total_tokens`;
                        `rollout.collect_episodes` refuses any other)
      prefill_buckets = those that fit in the cache (the cache itself when none does)
    check_config / row_buckets             what `SamplingEngine` refuses, the row shapes it compiles
    check_ids / check_fits / stop_row      the checks of what an episode puts in a row
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from jaxrl_agent.config import RolloutConfig, SamplingConfig


def agent_sampling(**overrides) -> SamplingConfig:
    """The sampling engine shape the agent jobs use: whole episodes of up to 1024 tokens."""
    base = dict(max_new_tokens=96, batch_size=16, cache_size=1024, prefill_buckets=(64, 128, 256, 512, 1024))
    return SamplingConfig(**{**base, **overrides})


def episode_engine(tokenizer, rollout: RolloutConfig, sampling: SamplingConfig | None = None,
                   **overrides) -> SamplingConfig:
    """`sampling` (default `agent_sampling()`) with `overrides` (batch_size, seed, ...) made fit
    to play `rollout`'s episodes with `tokenizer` (anything with `stop_ids`): see the module
    docstring for the three derived fields."""
    cfg = replace(sampling or agent_sampling(), **overrides)
    cache = rollout.max_total_tokens
    return replace(cfg, stop_token_ids=tuple(tokenizer.stop_ids), cache_size=cache,
                   prefill_buckets=tuple(b for b in cfg.prefill_buckets if b <= cache) or (cache,))


def row_buckets(cfg: SamplingConfig, decode: bool = False) -> tuple[int, ...]:
    """The allowed row counts of a prefill call (of a decode call with `decode`), ascending,
    always ending with B.

    Defaults: a prefill 1, ceil(B/4), B (a flush in a multi-turn rollout is often one row's
    tool result: `prefill_plan.py`); a decode ceil(B/4), ceil(B/2), B (benchmarks/bench_rollout.py)."""
    b = cfg.batch_size
    default = (-(-b // 4), -(-b // 2)) if decode else (1, -(-b // 4))
    given = (decode and cfg.decode_row_buckets) or cfg.prefill_row_buckets or default
    return tuple(sorted(set(given) | {b}))


def check_config(cfg: SamplingConfig, vocab_size: int) -> None:
    """Raise a ValueError for a SamplingConfig the engine cannot run."""
    problems = []
    if cfg.temperature < 0:
        problems.append(f"temperature={cfg.temperature} < 0")
    if cfg.top_k < 0:
        problems.append(f"top_k={cfg.top_k} < 0")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"top_p={cfg.top_p} not in (0, 1]")
    if cfg.batch_size < 1 or cfg.cache_size < 1 or cfg.max_new_tokens < 1:
        problems.append("batch_size, cache_size and max_new_tokens must be >= 1")
    if not cfg.prefill_buckets or min(cfg.prefill_buckets) < 1:
        problems.append(f"prefill_buckets={cfg.prefill_buckets} must be non-empty positive lengths")
    for name in ("prefill_row_buckets", "decode_row_buckets"):
        if any(not 1 <= r <= cfg.batch_size for r in getattr(cfg, name)):
            problems.append(f"{name}={getattr(cfg, name)} must lie in [1, batch_size={cfg.batch_size}]")
    if len(cfg.stop_token_ids) > cfg.max_stop_tokens:
        problems.append(f"{len(cfg.stop_token_ids)} stop_token_ids exceed max_stop_tokens={cfg.max_stop_tokens}")
    if any(not 0 <= t < vocab_size for t in cfg.stop_token_ids):
        problems.append(f"stop_token_ids={cfg.stop_token_ids} outside [0, vocab_size={vocab_size})")
    if problems:
        raise ValueError("invalid SamplingConfig: " + "; ".join(problems))


def check_ids(ids: Sequence[int], what: str, vocab_size: int) -> list[int]:
    """`ids` as a list of ints; a ValueError naming `what` unless 1-D ints in [0, vocab_size)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what} must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{what} holds ids outside [0, vocab_size={vocab_size}): min {arr.min()}, max {arr.max()}")
    return arr.astype(np.int64).tolist()


def check_fits(row: int, total: int, chunk: int, what: str, cache_size: int, buckets: tuple[int, ...]) -> None:
    """A ValueError unless a row can hold `total` tokens and prefill a `chunk` of them at once."""
    if total > cache_size:
        raise ValueError(f"{what} does not fit row {row}'s KV cache: the episode would hold {total} tokens "
                         f"but cache_size S={cache_size}")
    if chunk > buckets[-1]:
        raise ValueError(f"{what} does not fit a prefill bucket: {chunk} tokens to prefill in row {row}, "
                         f"largest bucket {buckets[-1]} (config.prefill_buckets={buckets})")


def stop_row(stop_ids: Sequence[int], max_stop_tokens: int, vocab_size: int) -> np.ndarray:
    """A row's stop set as int32 `[max_stop_tokens]`, padded with -1."""
    ids = check_ids(stop_ids, "stop_ids", vocab_size)
    if len(ids) > max_stop_tokens:
        raise ValueError(f"{len(ids)} stop ids exceed config.max_stop_tokens={max_stop_tokens}")
    row = np.full(max_stop_tokens, -1, np.int32)
    row[: len(ids)] = ids
    return row
