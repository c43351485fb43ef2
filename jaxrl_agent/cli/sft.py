"""HOST: `python -m jaxrl_agent sft`: expert demonstrations on training tasks -> SFT of a tiny
policy (or of `--sft.init`) -> an HF directory.

    generate_tasks --expert (env/expert.py) in the chat format's tool style--> demonstrations.jsonl
      --loops.offline.run_sft (LOSSES["sft"])--> <run_dir>/policy + sft_summary.json
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from flax import nnx

from jaxrl_agent.agent.demonstrations import collect_demonstrations
from jaxrl_agent.agent.policy import TinyModelConfig, load_policy
from jaxrl_agent.config import OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import generate_tasks
from jaxrl_agent.loops.offline import run_sft
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.tokenizer import ChatFormat, load_tokenizer
from jaxrl_agent.train.checkpoint import export_hf
from jaxrl_agent.trajectory import save_episodes


@dataclass(frozen=True)
class SFTConfig:
    """`sft`: demonstrations -> supervised fine-tuning."""

    split: str = "train"
    """Task split the demonstrations come from."""
    num_tasks: int = 64
    """Tasks demonstrated (each once per style)."""
    styles: tuple[str, ...] = ("perfect", "skip_tests", "first_bug_only", "recover_after_failing_run")
    """Expert imperfection styles (env/expert.py); the defaults' imperfections are decisions,
    with every demonstrated edit right, as in the study (README, "every demonstrated edit
    right")."""
    success_only: bool = False
    """Keep only demonstrations the verifier scored 1 (rejection-sampling fine-tuning)."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 8
    """Episodes per step."""
    group_by_length: int = 0
    """Batches of similar lengths, like HF's `group_by_length`: mega-batches of this many batches,
    each sorted by length (`offline.DataIterator`); 0 off. Less padding, every episode still
    once per epoch (benchmarks/bench_sft_batching.py)."""
    learning_rate: float = 3e-3
    """AdamW peak learning rate (cosine decay, short warm-up)."""
    init: str = ""
    """HF directory to start from ("" = a fresh tiny model of `model`)."""
    run_dir: str = "runs/sft"
    """Output: demonstrations (JSONL), metrics, and the policy (HF directory) in <run_dir>/policy."""
    seed: int = 0
    """Seed of the tasks, the expert's choices, initialisation and batch order."""
    sandbox_workers: int = 2
    """Sandbox workers for the expert's test runs and the verifier."""


@dataclass(frozen=True)
class SFTRunConfig:
    sft: SFTConfig = field(default_factory=SFTConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)


def run_sft_job(cfg: SFTRunConfig, *, show_progress: bool = True) -> dict:
    s = cfg.sft
    model, tok = load_policy(s.init) if s.init else (None, load_tokenizer())
    chat = ChatFormat(tok, tool_style="short")
    tasks = generate_tasks(s.split, s.num_tasks, s.seed)
    with Sandbox(num_workers=s.sandbox_workers) as sandbox:
        demos = collect_demonstrations(tasks, sandbox, chat, s.styles, threads=s.sandbox_workers)
    os.makedirs(s.run_dir, exist_ok=True)
    save_episodes(os.path.join(s.run_dir, "demonstrations.jsonl"), demos)
    rate = {st: sum(e.reward for e in demos if e.info["style"] == st) / max(1, len(tasks)) for st in s.styles}
    if s.success_only:
        demos = [e for e in demos if e.reward >= 1.0]
    if model is None:
        model = CausalLM(cfg.model.build(tok.vocab_size), rngs=nnx.Rngs(s.seed))
    optim = OptimConfig(learning_rate=s.learning_rate, schedule="cosine", warmup_steps=max(1, s.steps // 20),
                        total_steps=s.steps, min_lr_ratio=0.1, weight_decay=0.0, max_grad_norm=1.0)
    longest = max(len(e) for e in demos)
    traj = TrajectoryConfig(buckets=(256, 512, 768, 1024, 1536, 2048), overflow="truncate")
    history = []

    def on_step(step, metrics):
        history.append(metrics)
        if show_progress and (step % 25 == 0 or step == 1):
            print(f"sft step {step:4d}  nll {metrics['loss']:.4f}  ({metrics['step_time_s']:.2f}s/step)")

    state, _, ts = run_sft(model, demos, train_cfg=TrainConfig(), optim_cfg=optim, traj_cfg=traj,
                           num_steps=s.steps, batch_size=min(s.batch_size, len(demos)), seed=s.seed, on_step=on_step,
                           group_by_length=s.group_by_length)
    out = os.path.join(s.run_dir, "policy")
    export_hf(ts, state, model.config, out, tokenizer=tok)
    summary = {"demonstrations": len(demos), "longest_episode": longest, "expert_success": rate,
               "final_nll": history[-1]["loss"], "policy": out}
    with open(os.path.join(s.run_dir, "sft_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
