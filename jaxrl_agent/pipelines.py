"""HOST: the CLI's jobs (sft, train, eval, export), each a function of frozen configs, and the
pieces every job shares (policy loading, the agent's sampling shape, trajectory rendering).

    sft     expert demonstrations on training tasks -> SFT of a tiny policy -> HF directory
    train   RL (rl.train_rl) from an HF policy directory
    eval    pass@1 / pass@k + behaviour statistics of a policy on a task split -> JSON
    export  an orbax checkpoint of a run -> an HF directory transformers loads

The `demo` job, built on these, is demo.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from flax import nnx

from jaxrl_agent import hf
from jaxrl_agent.config import (OptimConfig, RewardConfig, RLConfig, RolloutConfig, SamplingConfig, TrainConfig,
                                TrajectoryConfig)
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.model import CausalLM, ModelConfig
from jaxrl_agent.tokenizer import ChatFormat, has_tokenizer_files, load_tokenizer

DEMO_POLICY_DIR = os.path.join(os.path.dirname(__file__), "assets", "demo_policy")


def agent_sampling(**overrides) -> SamplingConfig:
    """The sampling engine shape the agent jobs use: whole episodes of up to 1024 tokens."""
    base = dict(max_new_tokens=96, batch_size=16, cache_size=1024, prefill_buckets=(64, 128, 256, 512, 1024))
    return SamplingConfig(**{**base, **overrides})


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of a policy trained from scratch (Qwen2-style: qkv bias, tied embeddings)."""

    hidden_size: int = 128
    """D."""
    num_layers: int = 4
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads."""
    intermediate_size: int = 384
    """SwiGLU width."""

    def build(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.hidden_size // self.num_heads, rope_theta=10000.0, qkv_bias=True,
                           tie_word_embeddings=True, architecture="Qwen2ForCausalLM")


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


@dataclass(frozen=True)
class PolicyConfig:
    """Where a policy comes from."""

    path: str = DEMO_POLICY_DIR
    """HF checkpoint directory (the repo ships a tiny demo policy here)."""
    tokenizer: str = "file"
    """How its tokenizer is read (`tokenizer.load_tokenizer`): "file" (tokenizer.json as
    written: the tokenizer the policy trained with) or "auto" (what transformers' AutoTokenizer
    builds: Qwen2Tokenizer for our exports, whose pre-tokenizer is not the file's; for
    directories without tokenizer.json)."""


@dataclass(frozen=True)
class TrainRunConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=agent_sampling)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(learning_rate=1e-4))
    tools: ToolConfig = field(default_factory=ToolConfig)
    traj: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    resume: bool = False


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


# ---- shared pieces ----
def load_policy(path: str, tokenizer: str = "file"):
    """(model, tokenizer) from an HF directory; a clear error when it is missing. The tokenizer
    is the directory's own when it has one (read in `tokenizer` mode, `load_tokenizer`), else
    the repo's tiny tokenizer (older exports); one with more ids than the model has embedding
    rows is refused (sampling would index past it)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"policy directory {path!r} does not exist: train one with "
                                "`python -m jaxrl_agent sft` or pass --policy.path=DIR")
    model, _ = hf.load_pretrained(path)
    own = has_tokenizer_files(path)
    tok = load_tokenizer(path if own else None, tokenizer)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"{'the tokenizer in ' + repr(path) if own else 'the repo tokenizer'} has {tok.vocab_size} "
                         f"ids but the model in {path!r} has vocab_size={model.config.vocab_size}")
    return model, tok


def eval_tasks_for(cfg: EvalConfig, sandbox=None):
    """The tasks `cfg` names: its task file (checked in `sandbox`) or a generated split."""
    if cfg.task_file:
        from jaxrl_agent.env.verifier import load_checked_tasks

        return load_checked_tasks(cfg.task_file, sandbox)
    if cfg.split == "canonical":
        return [binary_search_task()]
    return generate_tasks(cfg.split, cfg.num_tasks, cfg.seed)


# ---- sft ----
def run_sft_job(cfg: SFTRunConfig, *, show_progress: bool = True) -> dict:
    from jaxrl_agent.demonstrations import collect_demonstrations
    from jaxrl_agent.offline import run_sft

    s = cfg.sft
    model, tok = load_policy(s.init) if s.init else (None, load_tokenizer())
    chat = ChatFormat(tok, tool_style="short")
    tasks = generate_tasks(s.split, s.num_tasks, s.seed)
    with Sandbox(num_workers=s.sandbox_workers) as sandbox:
        demos = collect_demonstrations(tasks, sandbox, chat, s.styles, threads=s.sandbox_workers)
    os.makedirs(s.run_dir, exist_ok=True)
    with open(os.path.join(s.run_dir, "demonstrations.jsonl"), "w") as f:
        for e in demos:
            f.write(json.dumps({"ids": e.ids, "loss_mask": e.loss_mask, "reward": e.reward, "info": e.info}) + "\n")
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
    from jaxrl_agent.checkpoint import export_hf

    out = os.path.join(s.run_dir, "policy")
    export_hf(ts, state, model.config, out, tokenizer=tok)
    summary = {"demonstrations": len(demos), "longest_episode": longest, "expert_success": rate,
               "final_nll": history[-1]["loss"], "policy": out}
    with open(os.path.join(s.run_dir, "sft_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


# ---- eval ----
def run_eval_job(cfg: EvalRunConfig, *, show_progress: bool = True) -> dict:
    from jaxrl_agent.multihost import Processes
    from jaxrl_agent.rl import evaluate
    from jaxrl_agent.sampling_engine import SamplingEngine

    procs = Processes.current()  # on N processes each runs its share; process 0 writes the summary

    model, tok = load_policy(cfg.policy.path, cfg.policy.tokenizer)
    chat = ChatFormat(tok, tool_style="short")
    engine = SamplingEngine(model, replace(cfg.sampling, stop_token_ids=tuple(tok.stop_ids),
                                           cache_size=cfg.rollout.max_total_tokens))
    # Each episode is written as it ends (<out>.episodes.jsonl); a failure late in the run
    # still leaves a summary of the episodes measured before it, marked partial.
    os.makedirs(os.path.dirname(os.path.abspath(cfg.eval.out)), exist_ok=True)
    suffix = f".process{procs.index}" if procs.index else ""
    done, log = [], open(os.path.splitext(cfg.eval.out)[0] + f".episodes{suffix}.jsonl", "w")

    def record(ep):
        done.append(ep)
        log.write(json.dumps({"task_id": ep.info.get("task_id"), "reward": ep.reward, "termination": ep.termination,
                              "reason": (ep.info.get("verify") or {}).get("reason"),
                              "behaviour": ep.info.get("behaviour")}, default=str) + "\n")
        log.flush()

    try:
        with Sandbox(num_workers=2, memo_entries=MEMO_ENTRIES if cfg.eval.sandbox_memo else 0) as sandbox:
            summary, _ = evaluate(eval_tasks_for(cfg.eval, sandbox), engine, chat, sandbox, cfg.rollout, cfg.tools,
                                  cfg.eval.samples, seed=cfg.eval.seed, show_progress=show_progress, on_episode=record,
                                  procs=procs)
    except BaseException as e:
        if done:
            from jaxrl_agent.evaluation import summarize_episodes
            with open(cfg.eval.out + suffix, "w") as f:
                json.dump({**summarize_episodes(done, 1), "partial": True, "error": repr(e)}, f, indent=2, default=str)
        raise
    finally:
        log.close()
    summary["policy"], summary["split"] = cfg.policy.path, cfg.eval.task_file or cfg.eval.split
    if procs.is_main:
        with open(cfg.eval.out, "w") as f:
            json.dump(summary, f, indent=2)
    if show_progress and procs.is_main:
        k = cfg.eval.samples
        print(f"{cfg.eval.task_file or cfg.eval.split}: pass@1 {summary['pass1']:.3f} [{summary['pass1_ci_low']:.3f}, "
              f"{summary['pass1_ci_high']:.3f}]  pass@{k} {summary.get(f'pass{k}', float('nan')):.3f}  -> {cfg.eval.out}")
    return summary


# ---- train ----
def run_train_job(cfg: TrainRunConfig, *, show_progress: bool = True) -> dict:
    from jaxrl_agent.rl import train_rl

    model, tok = load_policy(cfg.policy.path, cfg.policy.tokenizer)
    return train_rl(model, tok, rl=cfg.rl, rollout=cfg.rollout, sampling=cfg.sampling, train=cfg.train,
                    optim=cfg.optim, tools=cfg.tools, traj=cfg.traj, show_progress=show_progress, resume=cfg.resume,
                    rewards=cfg.rewards)


# ---- shared by the demo (demo.py) and the notebooks ----
def render_trajectory(episode, tokenizer, max_chars: int = 4000):
    """A rich Text of one episode: policy tokens (loss_mask 1) in bold green, observation /
    prompt tokens (loss_mask 0, masked out of the loss) dimmed."""
    from rich.text import Text

    text = Text()
    spans, cur, start = [], None, 0
    for i, m in enumerate(episode.loss_mask + [None]):
        if m != cur:
            if cur is not None:
                spans.append((cur, episode.ids[start:i]))
            cur, start = m, i
    shown = 0
    for m, ids in spans:
        piece = tokenizer.decode(ids)
        if shown + len(piece) > max_chars:
            piece = piece[: max(0, max_chars - shown)] + " ..."
        text.append(piece, style="bold green" if m == 1 else "dim")
        shown += len(piece)
        if shown >= max_chars:
            break
    return text


# ---- export ----
@dataclass(frozen=True)
class ExportConfig:
    """`export`: the latest orbax checkpoint of an RL run -> an HF directory."""

    run_dir: str = "runs/rl"
    """The RL run (its checkpoints are in <run_dir>/checkpoints)."""
    out: str = "runs/exported"
    """Output HF directory."""


@dataclass(frozen=True)
class ExportRunConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy the run started from (gives the architecture)."""
    export: ExportConfig = field(default_factory=ExportConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    """Must match the run's TrainConfig (LoRA rank, mesh) so the checkpoint's structure fits."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(learning_rate=1e-4))
    """Must match the run's optimizer (its state is part of the checkpoint)."""


def run_export_job(cfg: ExportRunConfig, *, show_progress: bool = True) -> dict:
    from jaxrl_agent.checkpoint import Checkpointer, export_hf
    from jaxrl_agent.config import CheckpointConfig
    from jaxrl_agent.loss_registry import LOSSES
    from jaxrl_agent.train_step import make_optimizer, make_train_step

    model, tok = load_policy(cfg.policy.path, cfg.policy.tokenizer)
    ckpt_dir = os.path.join(cfg.export.run_dir, "checkpoints")
    with Checkpointer(CheckpointConfig(directory=ckpt_dir)) as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint under {ckpt_dir!r}")
        step = ckpt.latest_step()
        ts = make_train_step(LOSSES["grpo"], make_optimizer(cfg.optim), cfg.train, model)
        state, _ = ckpt.restore(ts.abstract_state())
    export_hf(ts, state, model.config, cfg.export.out, tokenizer=tok)
    if show_progress:
        print(f"exported step {step} of {cfg.export.run_dir} -> {cfg.export.out}")
    return {"out": cfg.export.out, "step": step}
