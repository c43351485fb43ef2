"""HOST: how the RL loop turns its rollouts into train batches.

    rollout_batch_config(traj, ...)  once per run: one row count, a group's prompt shared or not,
                                     the prefix / packed shapes (row_layout.py does the cutting)
    start_precompile(ts, traj, ...)  the train step's length buckets compiled ahead of the updates
    local_batch(kept, traj, procs)   each iteration: this process's rows, padded like every other's

One home for the loop's collate settings; `loops/rl.py` calls these three and nothing else
decides how its batches are laid out.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from jaxrl_agent.agent.rollout import episode_prompt
from jaxrl_agent.config import RLConfig, RolloutConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.tasks import Task
from jaxrl_agent.loops.multihost import Processes
from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder
from jaxrl_agent.trajectory import Episode, bucket_length, collate, shape_episodes

# TrajectoryConfig.share_prefix_min=None in the loop: share a group's prompt once a batch is one update
SHARE_PREFIX_MIN = 32


def rollout_batch_config(traj: TrajectoryConfig, rl: RLConfig, rollout: RolloutConfig, train: TrainConfig,
                         mult: int, processes: int = 1, prompt_len: Callable[[], int] | None = None
                         ) -> TrajectoryConfig:
    """How the loop collates its rollout batches (`mult`: this process's row multiple): one row
    count per run (dropped episodes become padding rows), so one compile per length bucket;
    and `share_prefix_min=None` resolved: a group's prompt is shared (SHARE_PREFIX_MIN) when a
    batch is one update, not with mini-batches (TrajectoryConfig.share_prefix_min says why),
    and only when cutting the longest prompt (`prompt_len()`) out of the longest episode the
    budget allows lands it in a smaller length bucket: otherwise the rows pad to the same T and
    the prefixes only add work (`benchmarks/bench_update_layouts.py --buckets=1024`: episodes up to
    1024 tokens, ~175-token prompts). Never across processes (sharding.shard_local_batch) or in
    groups of one. With sharing the
    prefixes have one shape per run, which the loop precompiles: P a prefix per task and one
    for rows that share none, Tp the bucket of `prompt_len()` (the tasks' longest prompt; a
    longer one shares that many tokens) unless `prefix_buckets` is set. A packed forward
    (`pack_forward`, opt-in) shares nothing and stays in one process."""
    if not traj.row_buckets:
        rows = rl.tasks_per_iter * rollout.group_size // processes
        traj = replace(traj, row_buckets=(-(-rows // mult) * mult,))
    traj = replace(traj, batch_multiple=mult)
    if traj.pack_forward:
        if processes > 1:
            raise ValueError("TrajectoryConfig.pack_forward needs the whole batch in one process (each process's "
                             "pack_slot would point into its own packed rows): set traj.pack_forward=false")
        return traj if traj.share_prefix_min is not None else replace(traj, share_prefix_min=0)
    if traj.share_prefix_min is None:
        share = train.num_mini_batches == 1 and processes == 1 and rollout.group_size > 1 and prompt_len is not None
        if share:
            budget = rollout.max_total_tokens
            buckets = sorted({*traj.buckets, budget})  # train_rl adds the budget as a bucket
            share = bucket_length(max(budget - prompt_len() + 1, 1), buckets) < bucket_length(budget, buckets)
        traj = replace(traj, share_prefix_min=SHARE_PREFIX_MIN if share else 0)
    if processes > 1 or rollout.group_size < 2:
        return replace(traj, share_prefix_min=0)
    if traj.share_prefix_min:
        prefix_buckets = traj.prefix_buckets
        if not prefix_buckets:
            longest = min(prompt_len() - 1, max(traj.buckets)) if prompt_len else max(traj.buckets)
            prefix_buckets = (bucket_length(max(longest, traj.share_prefix_min), traj.buckets),)
        traj = replace(traj, prefix_rows=traj.prefix_rows or (-(-(rl.tasks_per_iter + 1) // mult) * mult,),
                       prefix_buckets=prefix_buckets)
    return traj


def longest_prompt(tasks: Sequence[Task], chat: ChatFormat, rollout: RolloutConfig, sample: int = 512) -> int:
    """Tokens in the longest first prompt (system, tools, task) among up to `sample` tasks."""
    step = max(1, len(tasks) // sample)
    return max(EpisodeBuilder(chat, episode_prompt(t, rollout.system_prompt), chat.tool_schemas).prompt_len
               for t in tasks[::step][:sample])


def local_batch(kept: list[Episode], traj: TrajectoryConfig, procs: Processes):
    """This process's rows of the update: every process pads to the same length bucket (the
    longest episode of all), and one with nothing to train on feeds rows without loss tokens."""
    if procs.count == 1:
        return collate(kept, traj)[0]
    longest = procs.max(max((len(e) for e in kept), default=1))
    bucket = min([b for b in traj.buckets if b >= longest] or [max(traj.buckets)])
    fill = kept or [Episode([traj.pad_id], [0], [0.0], [0], group_id=-(1 << 30))]
    return collate(fill, replace(traj, buckets=(bucket,)))[0]



def start_precompile(ts, traj: TrajectoryConfig, enabled: bool) -> Callable[..., None]:
    """Compile the train step for the run's length buckets ahead of the updates; returns
    `precompile_top(episode=None)`, which queues the top bucket (once).

    A batch pads to its longest episode's bucket. The smaller buckets compile at once, while
    iteration 1's rollout runs; the top one, the slowest to compile, is queued as soon as one of
    that rollout's episodes needs it (`precompile_top(episode)`), else once iteration 1 is done
    (`precompile_top()`): it does not compete with the first rollout for the cores unless the
    first update needs it (benchmarks/bench_startup.py). With `enabled` False nothing compiles
    ahead and `precompile_top` does nothing."""
    buckets, pad = sorted(traj.buckets), shape_episodes(traj)
    *smaller, top = [collate(pad, replace(traj, buckets=(t,)))[0] for t in buckets] if enabled else [None]
    below_top = buckets[-2] if len(buckets) > 1 else 0

    def precompile_top(episode: Episode | None = None) -> None:
        nonlocal top
        if top is not None and (episode is None or len(episode) > below_top):  # trajectory.bucket_length
            ts.precompile([top])
            top = None

    if enabled:
        ts.precompile(smaller)
        if not smaller:
            precompile_top()
    return precompile_top
