"""HOST: the `demo` job, the README's main command: a shipped (or freshly SFT'd) tiny policy,
held-out success before and after a short GRPO run with the study's RL recipe, and one
example trajectory with the masked observation tokens marked.

    DEMO_POLICY_DIR (or a quick SFT) --rl.train_rl--> before / after pass@1 with Wilson intervals
                                       `-> one binary-search episode, rendered
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from rich.console import Console

from jaxrl_agent.agent.evaluation import render_trajectory
from jaxrl_agent.agent.policy import DEMO_POLICY_DIR, load_policy
from jaxrl_agent.cli.sft import SFTConfig, SFTRunConfig, run_sft_job
from jaxrl_agent.config import LossConfig, OptimConfig, RLConfig, RolloutConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.loops.evaluate import evaluate
from jaxrl_agent.loops.rl import NoSignalError, train_rl
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import agent_sampling, episode_engine
from jaxrl_agent.tokenizer import ChatFormat
from jaxrl_agent.train.weight_sync import policy_for_engine


@dataclass(frozen=True)
class DemoConfig:
    """`demo`: held-out success before and after a short GRPO run with the study's RL recipe."""

    policy: str = DEMO_POLICY_DIR
    """SFT policy to start from (the repo ships one; if it is missing a quick SFT makes one)."""
    iterations: int = 8
    """RL iterations."""
    tasks_per_iter: int = 6
    """Training tasks per iteration (x group_size episodes)."""
    group_size: int = 8
    """Episodes per task."""
    eval_tasks: int = 32
    """Held-out tasks evaluated before and after (held-out instances, seed + 1)."""
    eval_samples: int = 4
    """Episodes per held-out task: 128 episodes, so a gain of about 0.2 has Wilson intervals apart."""
    learning_rate: float = 2e-4
    """RL learning rate (AdamW, constant)."""
    mini_batches: int = 4
    """Optimizer updates per rollout batch."""
    kl_coef: float = 0.1
    """k3 KL penalty to the start policy."""
    before_eval: str = "end"
    """When the starting policy's held-out evaluation runs (`rl.before_eval`): "end" (after
    training, the same figures) so the first iteration is not kept waiting, or "start"."""
    run_dir: str = "runs/demo"
    """Metrics, checkpoints and the trained policy."""
    seed: int = 0
    """Seed of tasks and sampling."""


@dataclass(frozen=True)
class DemoRunConfig:
    demo: DemoConfig = field(default_factory=DemoConfig)


def _demo_rl(model, tok, d: DemoConfig, show_progress: bool) -> dict:
    return train_rl(
        model, tok,
        rl=RLConfig(iterations=d.iterations, tasks_per_iter=d.tasks_per_iter, eval_tasks=d.eval_tasks,
                    eval_samples=d.eval_samples, eval_every=0, seed=d.seed, run_dir=d.run_dir, num_train_tasks=512,
                    before_eval=d.before_eval),
        rollout=RolloutConfig(group_size=d.group_size),
        sampling=agent_sampling(),
        train=TrainConfig(num_mini_batches=d.mini_batches, loss=LossConfig(kl_coef=d.kl_coef), use_ref=d.kl_coef > 0),
        optim=OptimConfig(learning_rate=d.learning_rate),
        traj=TrajectoryConfig(buckets=(512, 768, 1024)), show_progress=show_progress)


def run_demo_job(cfg: DemoRunConfig, *, show_progress: bool = True) -> dict:
    d = cfg.demo
    console = Console()
    policy = d.policy
    if not os.path.isdir(policy):
        console.print(f"[yellow]no policy at {policy}: making one with a quick SFT on expert demonstrations[/]")
        policy = run_sft_job(SFTRunConfig(sft=SFTConfig(num_tasks=48, steps=200, run_dir=os.path.join(d.run_dir, "sft"),
                                                        seed=d.seed)), show_progress=show_progress)["policy"]
    model, tok = load_policy(policy)
    try:
        res = _demo_rl(model, tok, d, show_progress)
    except NoSignalError as e:
        b = e.result["before"]
        console.print(f"\nheld-out pass@1 {b['pass1']:.3f}; failure layers {b['behaviour']['failure_layers']}")
        console.print(f"[bold red]no RL run:[/] {e}")
        return e.result
    if "before" not in res or "after" not in res:
        return res
    b, a = res["before"], res["after"]
    k = d.eval_samples
    apart = a["pass1_ci_low"] > b["pass1_ci_high"] or b["pass1_ci_low"] > a["pass1_ci_high"]
    ci = lambda e: f"{e['pass1']:.3f} [{e['pass1_ci_low']:.3f}, {e['pass1_ci_high']:.3f}]"  # noqa: E731
    console.print(f"\nheld-out instances ({d.eval_tasks} tasks x {k} episodes), pass@1 with Wilson 95% intervals:\n"
                  f"  before RL {ci(b)}\n  after RL  {ci(a)}  ({'apart' if apart else 'overlap: no claim'})\n"
                  f"  pass@{k} {b.get(f'pass{k}', 0):.3f} -> {a.get(f'pass{k}', 0):.3f}; "
                  f"failure layers before {b['behaviour']['failure_layers']}, after {a['behaviour']['failure_layers']}")
    # ---- one example trajectory of the trained policy ----
    engine = SamplingEngine(policy_for_engine(res["train_step"], res["state"]),
                            episode_engine(tok, RolloutConfig(), batch_size=1))
    with Sandbox(num_workers=1) as sandbox:
        _, eps = evaluate([binary_search_task()], engine, ChatFormat(tok, tool_style="short"), sandbox,
                          RolloutConfig(), ToolConfig(), 1, seed=d.seed, show_progress=False)
    console.print("\nexample trajectory on the binary-search task "
                  "([bold green]policy tokens, trained on[/], [dim]prompt / observation tokens, loss-masked[/]):")
    console.print(render_trajectory(eps[0], tok))
    console.print(f"reward {eps[0].reward}  termination {eps[0].termination}")
    return {"before": b, "after": a}
