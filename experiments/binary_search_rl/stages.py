"""The study's stages: demonstrations, SFT, RL (and its shuffled-reward control), evaluation.

Each stage writes its outputs under `<work_dir>/<stage>/` with the stamp of what made it
(`stage_cache.py`), so an interrupted study resumes where it stopped and a changed setting
recomputes exactly the stages that depend on it.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import asdict

from flax import nnx

from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.drills import (copy_sequences, make_drills, module_renamed_tasks, random_name_tasks,
                                                 whole_transcript_loss)
from experiments.binary_search_rl.parallel import run_stages
from experiments.binary_search_rl.silent_bugs import rl_pool
from experiments.binary_search_rl.stage_cache import cached, code_fingerprint, finish, policy_mtime, stage_dir
from jaxrl_agent.agent import evaluation
from jaxrl_agent.agent.demonstrations import collect_demonstrations
from jaxrl_agent.agent.policy import load_policy
from jaxrl_agent.config import (LossConfig, OptimConfig, RewardConfig, RLConfig, RolloutConfig, TrainConfig,
                                TrajectoryConfig)
from jaxrl_agent.env import expert
from jaxrl_agent.env.expert import STYLES
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.loops.evaluate import evaluate
from jaxrl_agent.loops.offline import run_sft
from jaxrl_agent.loops.rl import NoSignalError, train_rl
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import agent_sampling, episode_engine
from jaxrl_agent.tokenizer import ChatFormat, load_tokenizer
from jaxrl_agent.train.checkpoint import export_hf
from jaxrl_agent.trajectory import Episode, load_episodes, save_episodes

VALIDATION_SEED_OFFSET = 5555
"""Validation instances: `generate_tasks("train", n, seed + 5555)`, fresh instances of the
training templates (disjoint from the RL pool's stream). The gate, the learning curves and the
ablations read them; nothing is ever chosen on a held-out set."""
# Rows of the RL and evaluation sampling engines. A row's tokens do not depend on the other
# rows, so this only sets speed: 32 rows of 1024 slots (67 MB of KV cache) outgrow the 32 MB
# L3 cache: a 48-episode rollout took 13.9 s against 11.6 s with 16 (benchmarks/bench_rollout.py).
ENGINE_ROWS = 16


def tools_config(cfg: StudyConfig) -> ToolConfig:
    return ToolConfig(test_timeout_s=cfg.test_timeout_s, report_unchanged=cfg.report_unchanged_edits)


def tools_stamp(cfg: StudyConfig) -> dict:
    """What every stage that runs the tools depends on from them (the reporting of unchanged
    edits only when on, so the default stamps are the ones the cached stages carry)."""
    return {"test_timeout_s": cfg.test_timeout_s, **({"report_unchanged_edits": True} if cfg.report_unchanged_edits else {})}


def rollout_config(cfg: StudyConfig, **fields) -> RolloutConfig:
    """The rollout of every study stage: the verifier's per-test limit is the tools' one."""
    return RolloutConfig(verify_test_timeout_s=cfg.test_timeout_s, **fields)


def chat_format(cfg: StudyConfig, tok=None) -> ChatFormat:
    return ChatFormat(tok or load_tokenizer(), tool_style=cfg.tool_style)


# ---- 1. demonstrations ----
def _demo_stamp(cfg: StudyConfig) -> dict:
    """Everything the demonstrations depend on; the SFT stages carry it in their own stamps,
    so new demonstrations always retrain them (the test limit is quoted in test output)."""
    return {"demos": asdict(cfg.demos), "seed": cfg.seed, **tools_stamp(cfg),
            "tool_style": cfg.tool_style, "expert": code_fingerprint(expert)}


def _demo_path(cfg: StudyConfig) -> str:
    return os.path.join(stage_dir(cfg, "demos"), "demonstrations.jsonl")


def demonstrations(cfg: StudyConfig, sandbox) -> tuple[list[Episode], dict]:
    """One expert episode per training task, the style drawn per task from
    `cfg.demos.style_weights`; saved as JSONL (ids, masks, reward, info)."""
    d = cfg.demos
    if len(d.style_weights) != len(STYLES):
        raise ValueError(f"demos.style_weights needs {len(STYLES)} weights for {STYLES}, got {d.style_weights}")
    stamp = _demo_stamp(cfg)
    path = _demo_path(cfg)
    done = cached(cfg, "demos", stamp)
    if done is not None and os.path.exists(path):
        return load_episodes(path), done
    t0 = time.time()
    tasks = module_renamed_tasks(generate_tasks("train", d.num_tasks, cfg.seed), cfg.seed, made_up=True,
                                 share=d.made_up_modules, words=d.word_modules)
    rng = random.Random(cfg.seed)
    by_style: dict[str, list] = {s: [] for s in STYLES}
    for t in tasks:
        by_style[rng.choices(STYLES, weights=d.style_weights)[0]].append(t)
    episodes = []
    for style, ts in by_style.items():
        if ts:
            episodes += collect_demonstrations(ts, sandbox, chat_format(cfg), (style,),
                                               threads=cfg.sandbox_workers, tool_cfg=tools_config(cfg))
    save_episodes(path, episodes)
    n = len(episodes)
    result = {"episodes": n, "success": sum(e.reward >= 1 for e in episodes) / n,
              "per_style": {s: {"episodes": len(v), "success": sum(e.reward >= 1 for e in episodes
                                                                   if e.info["style"] == s) / max(1, len(v))}
                            for s, v in by_style.items()},
              "mean_tokens": sum(len(e) for e in episodes) / n,
              "mean_policy_tokens": sum(sum(e.loss_mask) for e in episodes) / n,
              "seconds": time.time() - t0}
    return episodes, finish(cfg, "demos", stamp, result)


# ---- 2. pretraining on edit drills, SFT (all demonstrations / successful ones only) ----
def _fit(cfg: StudyConfig, name: str, data: list[Episode], *, steps: int, batch_size: int, learning_rate: float,
         init: str | None, buckets: tuple[int, ...] = (512, 640, 768, 896, 1024, 1536, 2048),
         group_by_length: int = 0) -> dict:
    """Masked-NLL training of `init` (an HF policy directory; None: a fresh tiny model) on
    `data` padded to `buckets`, batches grouped by length when `group_by_length` > 1
    (`offline.DataIterator`); exported to `<work_dir>/<name>/policy`."""
    t0 = time.time()
    tok = load_tokenizer()
    if init:
        model, _ = load_policy(init)
    else:
        model = CausalLM(cfg.model.build(tok.vocab_size), rngs=nnx.Rngs(cfg.seed))
    optim = OptimConfig(learning_rate=learning_rate, schedule="cosine", warmup_steps=max(1, steps // 25),
                        total_steps=steps, min_lr_ratio=0.1, weight_decay=0.0, max_grad_norm=1.0)
    traj = TrajectoryConfig(buckets=buckets, overflow="truncate")
    nll = []

    def on_step(step, metrics):
        nll.append(metrics["loss"])
        if step % 50 == 0 or step == 1:
            print(f"[{name}] step {step:4d}/{steps}  nll {metrics['loss']:.4f}  ({time.time() - t0:.0f}s)", flush=True)

    state, _, ts = run_sft(model, data, train_cfg=TrainConfig(), optim_cfg=optim, traj_cfg=traj, num_steps=steps,
                           batch_size=min(batch_size, len(data)), seed=cfg.seed, on_step=on_step,
                           group_by_length=group_by_length)
    out = os.path.join(stage_dir(cfg, name), "policy")
    export_hf(ts, state, model.config, out, tokenizer=tok)
    return {"policy": out, "episodes": len(data), "nll": nll, "seconds": time.time() - t0}


def copy_stage(cfg: StudyConfig, chat) -> dict | None:
    """The copy circuit (`drills.copy_sequences` over every ordinary, not special, id of the
    tokenizer), the drills' starting point; None when `pretrain.copy_steps` is 0. Cached on
    its own: it depends on nothing the drills or the tool style change, so a new drill setting
    reuses it."""
    p = cfg.pretrain
    if p.copy_steps <= 0:
        return None
    stamp = {"copy": [p.copy_steps, p.copy_length, p.copy_batch_size, p.copy_learning_rate],
             "model": asdict(cfg.model), "seed": cfg.seed, "vocab": chat.tokenizer.vocab_size}
    done = cached(cfg, "pretrain_copy", stamp)
    if done is not None and os.path.isdir(done["policy"]):
        return done
    special = set(chat.tokenizer.added_vocab().values())
    ids = [i for i in range(chat.tokenizer.vocab_size) if i not in special]
    seqs = copy_sequences(p.copy_steps * p.copy_batch_size, ids, length=p.copy_length, seed=cfg.seed)
    return finish(cfg, "pretrain_copy", stamp, _fit(cfg, "pretrain_copy", seqs, steps=p.copy_steps,
                                                    batch_size=p.copy_batch_size, learning_rate=p.copy_learning_rate,
                                                    init=None, buckets=(p.copy_length,)))


def pretrain(cfg: StudyConfig) -> dict | None:
    """The drilled base model all policies start from (None when `pretrain.steps` is 0)."""
    p = cfg.pretrain
    if p.steps <= 0:
        return None
    stamp = {"pretrain": asdict(p), "model": asdict(cfg.model), "seed": cfg.seed, "tool_style": cfg.tool_style}
    done = cached(cfg, "pretrain", stamp)
    if done is not None:
        return done
    tasks = random_name_tasks(generate_tasks("train", p.num_tasks, cfg.seed + 100), p.random_names, cfg.seed)
    tasks = module_renamed_tasks(tasks, cfg.seed + 100, made_up=True, share=p.made_up_modules, words=p.word_modules)
    chat = chat_format(cfg)
    drills = make_drills(tasks, chat, seed=cfg.seed, extra_edits=p.extra_edits, mask_changes=p.mask_changes)
    if p.whole_transcript:
        drills = whole_transcript_loss(drills)
    copy = copy_stage(cfg, chat)
    init = copy and copy["policy"]
    result = _fit(cfg, "pretrain", drills, steps=p.steps, batch_size=p.batch_size, learning_rate=p.learning_rate,
                  init=init, group_by_length=p.group_by_length)
    if copy is not None:  # one stage: its seconds are the copy steps' and the drills'
        result |= {"copy_nll": copy["nll"], "copy_seconds": copy["seconds"],
                   "seconds": result["seconds"] + copy["seconds"]}
    return finish(cfg, "pretrain", stamp, result)


def sft(cfg: StudyConfig, name: str, episodes: list[Episode], demo_stamp: dict, base: dict | None, *,
        success_only: bool) -> dict:
    """The base model (or a fresh one) fine-tuned on the demonstrations (only reward-1 ones
    with `success_only`, i.e. rejection-sampling fine-tuning)."""
    s = cfg.sft
    stamp = {"sft": asdict(s), "model": asdict(cfg.model), "seed": cfg.seed, "success_only": success_only,
             "demos": demo_stamp, "base": base and base["policy"], "base_mtime": base and policy_mtime(base["policy"])}
    done = cached(cfg, name, stamp)
    if done is not None:
        return done
    data = [e for e in episodes if e.reward >= 1.0] if success_only else list(episodes)
    if not data:
        raise RuntimeError(f"{name}: no demonstrations to train on")
    return finish(cfg, name, stamp, _fit(cfg, name, data, steps=s.steps, batch_size=s.batch_size,
                                         learning_rate=s.learning_rate, init=base and base["policy"],
                                         group_by_length=s.group_by_length))


def demonstration_stage(cfg: StudyConfig) -> dict:
    """`demonstrations` with a sandbox of its own (a worker's call): the stage result; the
    episodes stay in the stage's file."""
    with Sandbox(num_workers=cfg.sandbox_workers, memo_entries=MEMO_ENTRIES) as sandbox:
        return demonstrations(cfg, sandbox)[1]


def sft_policies(cfg: StudyConfig, *, success_only: bool = True, jobs: int = 1) -> dict:
    """Stages 1-2 (each reused when cached): demonstrations and edit drills (independent, so
    side by side with `jobs` > 1), then SFT on all demos and, with `success_only`, SFT on the
    successful demos. Returns the stage results by name."""
    done = run_stages(jobs, [("demos", demonstration_stage, (cfg,), {}), ("pretrain", pretrain, (cfg,), {})])
    print(f"demonstrations: {done['demos']['episodes']} episodes, expert success {done['demos']['success']:.2f}",
          flush=True)
    base = done.pop("pretrain")
    if base is not None:
        done["pretrain"] = base
    demos, demo_stamp = load_episodes(_demo_path(cfg)), _demo_stamp(cfg)
    done["sft"] = sft(cfg, "sft", demos, demo_stamp, base, success_only=False)
    if success_only:
        done["sft_success_only"] = sft(cfg, "sft_success_only", demos, demo_stamp, base, success_only=True)
    return done


def success_only_sft(cfg: StudyConfig) -> dict:
    """The success-only baseline's stage result (a worker's call: its inputs come cached)."""
    return sft_policies(cfg)["sft_success_only"]


# ---- 3. RL and the shuffled-reward control ----
# per-iteration behaviour of the training rollouts kept in the stage result (name -> summed metrics;
# an edit is either tool style's edit call)
_BEHAVIOUR_SERIES = {"tool_errors": ("tool_errors_per_episode",), "interface_errors": ("interface_errors_per_episode",),
                     "submitted": ("terminations/submitted",),
                     "edits": ("tool_calls_per_episode/str_replace", "tool_calls_per_episode/replace_lines"),
                     "tokens": ("mean_tokens",)}


def behaviour_series(metrics: dict) -> dict[str, float]:
    """One iteration's training-rollout behaviour (`_BEHAVIOUR_SERIES`) from its flat metrics."""
    return {short: sum(metrics.get(f"rollout/{k}", 0.0) for k in keys) for short, keys in _BEHAVIOUR_SERIES.items()}


def validation_tasks(cfg: StudyConfig, n: int):
    return generate_tasks("train", n, cfg.seed + VALIDATION_SEED_OFFSET)


def sampler(cfg: StudyConfig, policy: str, seed: int) -> tuple[SamplingEngine, ChatFormat]:
    """The engine (whole episodes of the rollout's token budget) and chat format that sample
    `policy` for the gate and the evaluations."""
    model, tok = load_policy(policy, cfg.policy_tokenizer)
    engine = SamplingEngine(model, episode_engine(tok, rollout_config(cfg), batch_size=ENGINE_ROWS, seed=seed))
    return engine, chat_format(cfg, tok)


def gate_decision(layers: dict[str, float], min_sequential_share: float) -> dict:
    """From the share of episodes failing in each layer: each layer's share of the failures,
    whether RL starts (no failures, or at least `min_sequential_share` of them sequential),
    and else the reason, naming the layer that fails most."""
    failed = sum(layers.values())
    shares = {k: (v / failed if failed else 0.0) for k, v in layers.items()}
    passed = failed == 0 or shares.get("sequential", 0.0) >= min_sequential_share
    worst = max(shares, key=shares.get) if failed else None
    reason = None if passed else (
        f"{shares[worst]:.0%} of the SFT policy's failed validation episodes fail in the {worst} layer "
        f"(sequential {shares.get('sequential', 0.0):.0%} < {min_sequential_share:.0%}): fix that layer first, "
        "RL is not its cure")
    return {"failure_layer_shares": shares, "rl_starts": passed, "reason": reason}


def gate(cfg: StudyConfig, start: dict, sandbox) -> dict:
    """The SFT policy's sampled episodes on validation instances, by failure layer (DESIGN
    §9b): RL starts only when most failures are sequential decisions (`cfg.gate`)."""
    g = cfg.gate
    stamp = {"gate": asdict(g), "seed": cfg.seed, "policy": start["policy"], **tools_stamp(cfg),
             "tokenizer": cfg.policy_tokenizer,
             "policy_mtime": policy_mtime(start["policy"]), "evaluation_code": code_fingerprint(evaluation)}
    done = cached(cfg, "gate", stamp)
    if done is not None:
        return done
    t0 = time.time()
    engine, chat = sampler(cfg, start["policy"], cfg.seed)
    summary, _ = evaluate(validation_tasks(cfg, g.tasks), engine, chat, sandbox,
                          rollout_config(cfg), tools_config(cfg), g.samples, seed=cfg.seed, show_progress=False)
    layers = summary["behaviour"]["failure_layers"]
    result = {"pass1": summary["pass1"], f"pass{g.samples}": summary.get(f"pass{g.samples}"),
              "failure_layers": layers, **gate_decision(layers, g.min_sequential_share),
              "behaviour": summary["behaviour"], "seconds": time.time() - t0}
    shares, passed = result["failure_layer_shares"], result["rl_starts"]
    print(f"[gate] validation pass@1 {summary['pass1']:.3f}; failures by layer "
          + ", ".join(f"{k} {v:.2f}" for k, v in shares.items()) + ("" if passed else f" -> no RL: {result['reason']}"),
          flush=True)
    return finish(cfg, "gate", stamp, result)


def rl(cfg: StudyConfig, name: str, start: dict, *, shuffle_rewards: bool, algo: str | None = None,
       seed: int | None = None) -> dict:
    """`algo` (default cfg.rl.algo) from the SFT policy `start` with `seed` (default cfg.seed);
    with `shuffle_rewards` the rewards are permuted across each batch before the update (the
    control: same compute, no signal). The learning curve evaluates `cfg.rl.curve_tasks`
    validation instances (fresh training-template instances, never a held-out set)."""
    r = cfg.rl
    algo = algo or r.algo
    seed = cfg.seed if seed is None else seed
    run = {k: v for k, v in asdict(r).items() if k not in ("seeds", "second_algo")} | {"algo": algo}
    stamp = {"rl": run, "seed": seed, "shuffle": shuffle_rewards, "start": start["policy"],
             "start_mtime": policy_mtime(start["policy"]), **tools_stamp(cfg),
             "tokenizer": cfg.policy_tokenizer}
    done = cached(cfg, name, stamp)
    if done is not None:
        return done
    t0 = time.time()
    model, tok = load_policy(start["policy"], cfg.policy_tokenizer)
    run_dir = stage_dir(cfg, name)
    try:
        return _train(cfg, name, stamp, model, tok, run_dir, t0, shuffle_rewards, algo, seed)
    except NoSignalError as e:  # recorded, not raised: the study still reports the SFT policies
        print(f"[{name}] no RL run: {e}", flush=True)
        return finish(cfg, name, stamp, {"policy": None, "no_signal": str(e), "probe": e.result.get("probe"),
                                         "seconds": time.time() - t0})


def _train(cfg: StudyConfig, name: str, stamp: dict, model, tok, run_dir: str, t0: float,
           shuffle_rewards: bool, algo: str, seed: int) -> dict:
    r = cfg.rl
    res = train_rl(
        model, tok,
        rl=RLConfig(algo=algo, iterations=r.iterations, tasks_per_iter=r.tasks_per_iter, train_split="train",
                    num_train_tasks=r.num_train_tasks, eval_samples=1, eval_every=r.eval_every,
                    shuffle_rewards=shuffle_rewards, require_signal=r.require_signal, seed=seed, keep_best=r.keep_best,
                    run_dir=run_dir, checkpoint_every=r.iterations, sandbox_workers=cfg.sandbox_workers),
        rollout=rollout_config(cfg, group_size=r.group_size), sampling=agent_sampling(batch_size=ENGINE_ROWS),
        # the group baselines see the whole batch: TrainStep computes them before the mini-batch split
        train=TrainConfig(num_mini_batches=r.mini_batches, loss=LossConfig(kl_coef=r.kl_coef, agg=r.agg),
                          use_ref=r.kl_coef > 0),
        optim=OptimConfig(learning_rate=r.learning_rate), tools=tools_config(cfg),
        rewards=RewardConfig(tool_error_penalty=r.tool_error_penalty,
                             interface_error_penalty=r.interface_error_penalty,
                             unchanged_edit_penalty=r.unchanged_edit_penalty),
        traj=TrajectoryConfig(buckets=(512, 768, 1024)), eval_tasks=validation_tasks(cfg, r.curve_tasks),
        train_tasks=rl_pool(r.num_train_tasks, seed, r.silent_bug_share, r.canonical_like_share),
        show_progress=False, tool_style=cfg.tool_style,
        on_iteration=lambda it, m: print(f"[{name}] iter {it:3d}  reward {m['rollout/reward_mean']:.3f}"
                                         + (f"  validation {m['eval/pass1']:.3f}" if "eval/pass1" in m else ""),
                                         flush=True))
    if res.get("interrupted"):
        raise KeyboardInterrupt
    curve = [{"iteration": 0, "validation_pass1": res["before"]["pass1"]}]
    train_reward = []
    for it, m in enumerate(res["iterations"], start=1):  # flat metrics, "section/name" keys
        train_reward.append({"iteration": it, "reward": m["rollout/reward_mean"], "success": m["rollout/success"],
                             "loss": m.get("train/loss"), "mixed_groups": m.get("rollout/mixed_group_share"),
                             **behaviour_series(m)})
        if "eval/pass1" in m:
            curve.append({"iteration": it, "validation_pass1": m["eval/pass1"]})
    curve.append({"iteration": r.iterations, "validation_pass1": res["after"]["pass1"]})
    invariants = {"verifier_check": res.get("verifier_check"), "repeatable": res.get("repeatable"),
                  "probe": res.get("probe")}
    best = res.get("best") if r.keep_best else None  # early stopping on the validation curve
    return finish(cfg, name, stamp, {"policy": best["policy"] if best else os.path.join(run_dir, "policy"),
                                     "selected_iteration": best["iteration"] if best else r.iterations,
                                     "train_reward": train_reward, "validation_curve": curve,
                                     "invariants": invariants, "seconds": time.time() - t0})


# ---- 4. evaluation ----
def eval_sets(cfg: StudyConfig, passk: bool = False) -> dict:
    """split -> (tasks, episodes per task); `passk`: 8 episodes per held-out instance."""
    e = cfg.eval
    return {"canonical": ([binary_search_task()], e.canonical_samples),
            "heldout_instances": (generate_tasks("heldout_instances", e.heldout_instance_tasks, e.seed),
                                  e.passk_samples if passk else e.samples_per_task),
            "heldout_templates": (generate_tasks("heldout_templates", e.heldout_template_tasks, e.seed),
                                  e.samples_per_task)}


def evaluate_policy(cfg: StudyConfig, name: str, policy: str, sandbox, *, passk: bool = False) -> dict:
    """pass@1 / pass@k with Wilson intervals and behaviour statistics on the three sets (with
    `passk`, `eval.passk_samples` episodes per held-out instance); the first canonical episode
    is kept (ids + masks) for the rendered example trajectory."""
    stamp = {"eval": asdict(cfg.eval), "policy": policy, **tools_stamp(cfg),
             "tokenizer": cfg.policy_tokenizer,
             "policy_mtime": policy_mtime(policy), "passk": passk, "evaluation_code": code_fingerprint(evaluation)}
    key = f"eval_{name}"
    done = cached(cfg, key, stamp)
    if done is not None:
        return done
    t0 = time.time()
    engine, chat = sampler(cfg, policy, cfg.eval.seed)
    rollout = rollout_config(cfg)
    out: dict = {}
    for split, (tasks, k) in eval_sets(cfg, passk).items():
        summary, eps = evaluate(tasks, engine, chat, sandbox, rollout, tools_config(cfg), k, seed=cfg.eval.seed,
                                show_progress=False)
        summary.pop("signal", None)
        out[split] = summary
        if split == "canonical":
            ex = eps[0]  # the first sampled episode, whatever its outcome (no cherry-picking)
            out["example"] = {"ids": ex.ids, "loss_mask": ex.loss_mask, "reward": ex.reward,
                              "termination": ex.termination}
        print(f"[{name}] {split}: pass@1 {summary['pass1']:.3f} [{summary['pass1_ci_low']:.3f}, "
              f"{summary['pass1_ci_high']:.3f}]", flush=True)
    out["seconds"] = time.time() - t0
    return finish(cfg, key, stamp, out)


def evaluate_alone(cfg: StudyConfig, name: str, policy: str, *, passk: bool = False) -> dict:
    """`evaluate_policy` with a sandbox of its own (a worker's call)."""
    with Sandbox(num_workers=cfg.sandbox_workers, memo_entries=MEMO_ENTRIES) as sandbox:
        return evaluate_policy(cfg, name, policy, sandbox, passk=passk)
