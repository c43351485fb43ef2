"""HOST: `python -m jaxrl_agent eval`: pass@1 / pass@k and behaviour statistics of a policy on a
task split or a task file -> JSON.

    PolicyConfig --load_policy--> engine (sampling.engine_config.episode_engine)
      --loops.evaluate.evaluate (on every process's share)--> <out> summary (+ <out>.episodes.jsonl,
      every episode as it ends, `trajectory.save_episodes`; a failure leaves a summary marked
      partial)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from jaxrl_agent.agent.evaluation import summarize_episodes
from jaxrl_agent.agent.policy import PolicyConfig, load_policy
from jaxrl_agent.config import RolloutConfig, SamplingConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.env.verifier import load_checked_tasks
from jaxrl_agent.loops.evaluate import evaluate
from jaxrl_agent.loops.multihost import Processes
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import agent_sampling, episode_engine
from jaxrl_agent.tokenizer import ChatFormat
from jaxrl_agent.trajectory import save_episodes


@dataclass(frozen=True)
class EvalConfig:
    """`eval`: a policy on a task split."""

    split: str = "heldout_instances"
    """train | heldout_instances | heldout_templates | canonical (the binary-search task)."""
    num_tasks: int = 32
    """Tasks evaluated (canonical: the one task)."""
    samples: int = 4
    """Episodes per task (pass@k with k = samples)."""
    seed: int = 1
    """Task generation and sampling seed."""
    task_file: str = ""
    """JSONL task file (`env.tasks.save_tasks` format) evaluated instead of `split` /
    `num_tasks`; every task is checked in the sandbox first (`verifier.check_task`)."""
    out: str = "runs/eval.json"
    """Where the JSON summary goes."""
    sandbox_memo: bool = True
    """Identical sandbox calls share one execution (as `rl.sandbox_memo`)."""


@dataclass(frozen=True)
class EvalRunConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=agent_sampling)
    tools: ToolConfig = field(default_factory=ToolConfig)


def eval_tasks_for(cfg: EvalConfig, sandbox=None):
    """The tasks `cfg` names: its task file (checked in `sandbox`) or a generated split."""
    if cfg.task_file:
        return load_checked_tasks(cfg.task_file, sandbox)
    if cfg.split == "canonical":
        return [binary_search_task()]
    return generate_tasks(cfg.split, cfg.num_tasks, cfg.seed)


def run_eval_job(cfg: EvalRunConfig, *, show_progress: bool = True) -> dict:
    procs = Processes.current()  # on N processes each runs its share; process 0 writes the summary

    model, tok = load_policy(cfg.policy.path, cfg.policy.tokenizer)
    chat = ChatFormat(tok, tool_style="short")
    engine = SamplingEngine(model, episode_engine(tok, cfg.rollout, cfg.sampling))
    # Each episode is appended as it ends (<out>.episodes.jsonl, the episode file of
    # `trajectory.save_episodes`: `load_episodes` reads it back); a failure late in the run
    # still leaves a summary of the episodes measured before it, marked partial.
    os.makedirs(os.path.dirname(os.path.abspath(cfg.eval.out)), exist_ok=True)
    suffix = f".process{procs.index}" if procs.index else ""
    episodes_path, done = os.path.splitext(cfg.eval.out)[0] + f".episodes{suffix}.jsonl", []
    save_episodes(episodes_path, [])

    def record(ep):
        done.append(ep)
        save_episodes(episodes_path, [ep], append=True)

    try:
        with Sandbox(num_workers=2, memo_entries=MEMO_ENTRIES if cfg.eval.sandbox_memo else 0) as sandbox:
            summary, _ = evaluate(eval_tasks_for(cfg.eval, sandbox), engine, chat, sandbox, cfg.rollout, cfg.tools,
                                  cfg.eval.samples, seed=cfg.eval.seed, show_progress=show_progress, on_episode=record,
                                  procs=procs)
    except BaseException as e:
        if done:
            with open(cfg.eval.out + suffix, "w") as f:
                json.dump({**summarize_episodes(done, 1), "partial": True, "error": repr(e)}, f, indent=2, default=str)
        raise
    summary["policy"], summary["split"] = cfg.policy.path, cfg.eval.task_file or cfg.eval.split
    if procs.is_main:
        with open(cfg.eval.out, "w") as f:
            json.dump(summary, f, indent=2)
    if show_progress and procs.is_main:
        k = cfg.eval.samples
        print(f"{cfg.eval.task_file or cfg.eval.split}: pass@1 {summary['pass1']:.3f} [{summary['pass1_ci_low']:.3f}, "
              f"{summary['pass1_ci_high']:.3f}]  pass@{k} {summary.get(f'pass{k}', float('nan')):.3f}  -> {cfg.eval.out}")
    return summary
