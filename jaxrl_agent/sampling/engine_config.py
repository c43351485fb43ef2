"""HOST: the one place a sampling engine's config is derived and checked.

    agent_sampling(**overrides)            the agent jobs' engine shape (whole episodes of up to
                                           1024 tokens; turns of up to 96)
    episode_engine(tokenizer, rollout)     + the rules an episode engine must obey:
      stop_token_ids  = the tokenizer's stop ids (<|im_end|>, end of text)
      cache_size      = the rollout's token budget (`RolloutConfig.max_total_tokens`;
                        `rollout.collect_episodes` refuses any other)
      prefill_buckets = those that fit in the cache (the cache itself when none does)
    check_config / row_buckets             what `SamplingEngine` refuses, the row shapes it compiles
"""
from __future__ import annotations

from dataclasses import replace

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
