"""HOST: a policy's episodes on a task list, split across the processes of a job, and its
evaluation (pass@1 / pass@k with Wilson intervals, behaviour, failure layers).

    process p of P: tasks[lo_p:hi_p] --collect_share (seeds and group ids as one process gives)-->
      its episodes --gather_episodes (light copies, allgather)--> every episode, every process
      --evaluation.summarize_episodes--> the summary (the same on every process)

The RL loop samples its training batches and its held-out evaluations through these; the
`eval` command and the study's evaluations call `evaluate`.
"""
from __future__ import annotations

from dataclasses import replace

from jaxrl_agent.agent.evaluation import summarize_episodes
from jaxrl_agent.agent.rollout import collect_episodes, group_signal
from jaxrl_agent.config import RolloutConfig
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.loops.metrics import progress_bar
from jaxrl_agent.loops.multihost import Processes, light, merge_stats
from jaxrl_agent.trajectory import Episode


def collect_share(procs: Processes, tasks, engine, chat, sandbox, cfg: RolloutConfig, tool_cfg: ToolConfig, *,
                  seed: int, progress=None, on_episode=None) -> tuple[list[Episode], dict]:
    """This process's share of `tasks` (`cfg.group_size` episodes each) with the seeds and
    group ids one process would give them; returns (its episodes, its `RolloutStats` dict).
    No cross-process communication (safe in the one-step-off rollout thread)."""
    lo, hi = procs.share(len(tasks))
    eps, stats = collect_episodes(tasks[lo:hi], engine, chat, sandbox, cfg, tool_cfg, seed=seed + lo * cfg.group_size,
                                  first_group_id=lo, progress=progress, on_episode=on_episode)
    return eps, stats.as_dict()


def gather_episodes(procs: Processes, episodes: list[Episode], stats: dict) -> tuple[list[Episode], dict]:
    """Every process's episodes (light copies, no token ids, in task order) and their merged
    cost; on one process the arguments themselves."""
    if procs.count == 1:
        return episodes, stats
    return procs.concat([light(e) for e in episodes]), merge_stats(procs.allgather(stats))


def evaluate(tasks, engine, chat, sandbox, rollout_cfg: RolloutConfig, tool_cfg: ToolConfig, k: int, *,
             seed: int, show_progress: bool = True, description: str = "eval",
             on_episode=None, procs: Processes = Processes()) -> tuple[dict, list]:
    """pass@1 / pass@k with Wilson intervals and behaviour statistics on `tasks` (k episodes
    each); `on_episode(episode)` sees each episode as it ends. With `procs` of a multi-process
    job every process runs its share and the summary covers all; the returned episodes are
    this process's."""
    cfg = replace(rollout_cfg, group_size=k)
    lo, hi = procs.share(len(tasks))
    with progress_bar((hi - lo) * k, description, enabled=show_progress and procs.is_main) as advance:
        eps, stats = collect_share(procs, tasks, engine, chat, sandbox, cfg, tool_cfg, seed=seed, progress=advance,
                                   on_episode=on_episode)
    every, cost = gather_episodes(procs, eps, stats)
    summary = summarize_episodes(every, k)
    summary["signal"] = group_signal(every)
    summary["cost"] = cost
    return summary, eps
