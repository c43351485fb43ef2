"""HOST: the RL loop: rollouts on training tasks -> one sharded train step -> repeat.

    for it in iterations:
        tasks    = next tasks from the seeded, resumable task iterator
        episodes = rollout.collect_episodes(tasks, engine, ...)     # G per task, verifier reward
        scored   = rewards.RewardComposer(episodes)                   # verifier / reward model / sum, shaping
        kept     = rollout.trainable(scored)                          # drop sandbox errors, (DAPO) flat groups
        batch    = trajectory.collate(kept)                           # the only place that pads
        state    = train_step(state, batch)                           # LOSSES[algo], optax
        engine.update_params(policy)                                  # no recompilation
        log / evaluate held-out / checkpoint

On a multi-process job (`jax.distributed`) each process rolls out its contiguous share of the
iteration's tasks on its own engine and sandbox and feeds only its own rows to the train step
(`loops/multihost.py` says what is split and what is global). With `rl.max_staleness=1` the next
iteration's rollouts run in a background thread on the previous policy while the update runs
(one-step-off-policy, as verl / AReaL do); the thread does no cross-process communication, the
main thread does it all, so the collectives of the rollout and of the update never interleave.

Before training it answers the questions that decide whether RL is worth running (DESIGN §9b):
is the reward trustworthy (the verifier scores the reference fix 1 and the buggy code 0 on the
run's own tasks), does the policy explore (pass@k and the share of groups with mixed rewards
on iteration 1's batch, sampled first and then trained on), is the environment repeatable
(the same seed gives the same episode), and what it costs (time split, tokens per second). A policy whose pass@k is 0 gives RL no signal:
the loop says so and stops instead of training (`RLConfig.require_signal`).
"""
from __future__ import annotations

import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from jaxrl_agent.agent.evaluation import summarize_episodes
from jaxrl_agent.agent.rewards import RewardComposer
from jaxrl_agent.agent.rollout import collect_episodes, group_signal, trainable
from jaxrl_agent.config import (CheckpointConfig, OptimConfig, RewardConfig, RLConfig, RolloutConfig, SamplingConfig,
                                TrainConfig, TrajectoryConfig)
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
from jaxrl_agent.env.tasks import GeneratedTasks, Task, workspace_files
from jaxrl_agent.env.tools import ToolConfig, create_workspaces
from jaxrl_agent.env.verifier import load_checked_tasks, verify
from jaxrl_agent.loops.evaluate import collect_share, evaluate, gather_episodes
from jaxrl_agent.loops.metrics import MetricsLogger, Timer, compile_seconds, progress_bar, watch_compiles
from jaxrl_agent.loops.multihost import Processes
from jaxrl_agent.loops.offline import DataIterator
from jaxrl_agent.loops.rollout_batches import local_batch, longest_prompt, rollout_batch_config, start_precompile
from jaxrl_agent.losses.registry import LOSSES, RL_LOSSES
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import episode_engine
from jaxrl_agent.tokenizer import ChatFormat
from jaxrl_agent.train import sharding as sh
from jaxrl_agent.train.checkpoint import Checkpointer, export_hf
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.train.weight_sync import policy_for_engine


class NoSignalError(RuntimeError):
    """The starting policy never succeeds on the training tasks: RL has nothing to reinforce.

    `.result` holds what the loop measured before it stopped (checks, probe, held-out eval).
    """

    def __init__(self, result: dict, message: str):
        super().__init__(message)
        self.result = result


def verifier_check(tasks: list[Task], sandbox, n: int = 2) -> dict:
    """Is the reward trustworthy? The reference fix must score 1 and the buggy code 0."""
    ok_ref = ok_bug = 0
    with tempfile.TemporaryDirectory(prefix="jxa-vcheck-") as root:
        for i, task in enumerate(tasks[:n]):
            ref = create_workspaces({**workspace_files(task), **task.reference_files}, os.path.join(root, f"r{i}"), 1)[0]
            bug = create_workspaces(workspace_files(task), os.path.join(root, f"b{i}"), 1)[0]
            ok_ref += verify(task, ref, sandbox).reward == 1.0
            ok_bug += verify(task, bug, sandbox).reward == 0.0
    n = min(n, len(tasks))
    return {"reference_scores_1": ok_ref / max(n, 1), "buggy_scores_0": ok_bug / max(n, 1), "n": n}


def train_rl(model, tokenizer, *, rl: RLConfig, rollout: RolloutConfig, sampling: SamplingConfig,
             train: TrainConfig, optim: OptimConfig, tools: ToolConfig = ToolConfig(),
             traj: TrajectoryConfig = TrajectoryConfig(), train_tasks: list[Task] | None = None,
             eval_tasks: list[Task] | None = None, show_progress: bool = True, resume: bool = False,
             tool_style: str = "short", on_iteration=None, rewards: RewardConfig = RewardConfig(),
             reward_model=None) -> dict:
    """Run RL from `model`; returns the before/after evaluations and per-iteration metrics.

    Writes `<run_dir>/metrics.jsonl` (+ TensorBoard), checkpoints under `<run_dir>/checkpoints`
    (resumable with `resume=True`), and the final policy as an HF directory `<run_dir>/policy`
    (with `rl.keep_best`, also the best evaluated one as `<run_dir>/best_policy`).
    Ctrl-C saves a checkpoint and returns what was done so far. `on_iteration(it, metrics)`
    is called after each iteration's log line (monitoring, notebooks).

    `rewards` says what the update trains on (default: the verifier's reward alone); a reward
    model comes from `rewards.reward_model_path` or, already built, as `reward_model` (a
    frozen `reward_model.RewardModel`). Success rates and evaluations always read the verifier.
    """
    if rl.algo not in RL_LOSSES:
        raise ValueError(f"rl.algo must be an RL loss in {RL_LOSSES}, got {rl.algo!r}")
    if train.loss.kl_coef and not train.use_ref:  # rollout batches carry no ref_logp: fail before any rollout
        raise ValueError(f"train.loss.kl_coef={train.loss.kl_coef} needs a reference policy: set train.use_ref=true")
    watch_compiles()  # time/compile (a no-op if the CLI already watches)
    chat = ChatFormat(tokenizer, tool_style=tool_style)
    sampling = episode_engine(tokenizer, rollout, sampling, seed=rl.seed)
    if max(traj.buckets) < rollout.max_total_tokens:
        traj = replace(traj, buckets=(*traj.buckets, rollout.max_total_tokens))
    if (train_tasks is None and rl.train_file) or (eval_tasks is None and rl.eval_file):
        with Sandbox(num_workers=rl.sandbox_workers) as sandbox:  # foreign tasks: checked before anything runs
            if train_tasks is None and rl.train_file:
                train_tasks = load_checked_tasks(rl.train_file, sandbox)
            if eval_tasks is None and rl.eval_file:
                eval_tasks = load_checked_tasks(rl.eval_file, sandbox)
    # made when first read: the first iteration waits for its own tasks only
    train_tasks = train_tasks or GeneratedTasks(rl.train_split, rl.num_train_tasks, rl.seed)
    eval_tasks = eval_tasks or GeneratedTasks(rl.eval_split, rl.eval_tasks, rl.seed + 1)
    if not 1 <= rl.tasks_per_iter <= len(train_tasks):
        raise ValueError(f"rl.tasks_per_iter={rl.tasks_per_iter} must be in [1, {len(train_tasks)}], the number of "
                         f"training tasks{f' in {rl.train_file}' if rl.train_file else ''}")
    if rl.before_eval not in ("start", "end"):
        raise ValueError(f"rl.before_eval={rl.before_eval!r}: \"start\" (before the first iteration) or \"end\" "
                         "(after the last, on the kept starting params)")
    if rl.max_staleness not in (0, 1):
        raise ValueError(f"rl.max_staleness={rl.max_staleness}: 0 (synchronous) and 1 (one-step-off-policy) "
                         "are supported")
    if rl.max_staleness:  # stale samples: PPO's ratio against the trainer's policy, IS against the sampler's
        train = replace(train, old_logp="recompute",
                        loss=replace(train.loss, tis_cap=2.0 if train.loss.tis_cap is None else train.loss.tis_cap))
    procs = Processes.current()
    if rl.tasks_per_iter % procs.count:
        raise ValueError(f"rl.tasks_per_iter={rl.tasks_per_iter} must be a multiple of the {procs.count} processes "
                         "(each rolls out whole groups of the same number of tasks)")
    ts = make_train_step(LOSSES[rl.algo], make_optimizer(optim), train, model)
    mult = math.lcm(traj.batch_multiple, sh.batch_size_multiple(ts.mesh))
    if mult % procs.count:
        raise ValueError(f"the mesh's data*fsdp={mult} rows must split evenly over {procs.count} processes")
    mult //= procs.count  # rows of this process
    traj = rollout_batch_config(traj, rl, rollout, train, mult, procs.count,
                                prompt_len=lambda: longest_prompt(train_tasks, chat, rollout))
    precompile_top = start_precompile(ts, traj, rl.precompile)
    data = DataIterator(train_tasks, rl.tasks_per_iter, seed=rl.seed)
    ckpt = Checkpointer(CheckpointConfig(directory=os.path.join(rl.run_dir, "checkpoints"),
                                         save_every=rl.checkpoint_every))
    state = ts.init_state(model, seed=rl.seed)
    composer = RewardComposer(rewards, _reward_model(rewards, reward_model, traj),
                              gather=(lambda x: np.concatenate(procs.allgather(x))) if procs.count > 1 else None)
    start, best = 0, None
    if resume and ckpt.latest_step() is not None:
        start = ckpt.latest_step()  # checkpoints are numbered by iteration (an iteration may skip its update)
        state, meta = ckpt.restore(ts.abstract_state())
        data.restore(meta["data_position"])
        if "reward_norm" in meta["extra"]:
            composer.stats.load_state_dict(meta["extra"]["reward_norm"])
        best = meta["extra"].get("best")  # the best policy evaluated before the stop (rl.keep_best)
    engine = SamplingEngine(policy_for_engine(ts, state), sampling)
    engine_version = int(state.step)  # the update count of the policy the engine samples from
    log = MetricsLogger(rl.run_dir, enabled=procs.is_main)
    timer = Timer()
    result: dict = {"iterations": [], "best": best}
    position = done_position = data.position()  # after this / the last completed iteration's tasks

    def save(it: int, data_position: dict) -> None:
        if ckpt.latest_step() != it:  # the periodic save may already hold this iteration
            ckpt.save(it, state, data_position=data_position, config=train,
                      extra={"rl": rl, "optim": optim, "rewards": rewards, "reward_norm": composer.stats.state_dict(),
                             "best": result["best"]})

    def keep_best(it: int, ev: dict) -> None:
        """Export the policy evaluated at `it` if its pass@1 is the best so far (ties: the later)."""
        if rl.keep_best and (result["best"] is None or ev["pass1"] >= result["best"]["pass1"]):
            path = os.path.join(rl.run_dir, "best_policy")
            export_hf(ts, state, model.config, path, tokenizer=tokenizer, write=procs.is_main)
            result["best"] = {"iteration": it, "pass1": float(ev["pass1"]), "policy": path}

    def rollout_seed(it: int) -> int:
        return rl.seed * 1_000_003 + it * 10_007

    def rollout_share(tasks, it: int, version: int, progress=None, on_episode=None):
        eps, stats = collect_share(procs, tasks, engine, chat, sandbox, rollout, tools, seed=rollout_seed(it),
                                   progress=progress, on_episode=on_episode)
        return [replace(e, info={**e.info, "policy_version": version}) for e in eps], stats

    def sample_iteration(it: int, description: str, on_episode=None):
        """The next tasks' rollout on this process: (data position after them, its episodes, stats)."""
        tasks = data.next()
        n_local = len(range(*procs.share(len(tasks)))) * rollout.group_size
        with progress_bar(n_local, description, show_progress and procs.is_main) as adv:
            return (data.position(), tasks, *rollout_share(tasks, it, engine_version, adv, on_episode))

    def eval_before() -> dict:
        return evaluate(eval_tasks, engine, chat, sandbox, rollout, tools, rl.eval_samples, seed=rl.seed + 11,
                        show_progress=show_progress, description="eval before", procs=procs)[0]

    last_done = start
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jxa-rollout") if rl.max_staleness else None
    ahead = None  # (the next iteration's data position, the Future of its rollout) one step off
    with Sandbox(num_workers=rl.sandbox_workers, memo_entries=MEMO_ENTRIES if rl.sandbox_memo else 0) as sandbox:
        try:
            # ---- before training: is RL worth running? ----
            first = None  # iteration 1's rollout, sampled here: its episodes are the probe
            start_params = None  # the starting policy, kept for a held-out evaluation at the end
            if start == 0:
                result["verifier_check"] = verifier_check(train_tasks, sandbox)
                with timer("rollout"):
                    position, tasks, local, rstats = sample_iteration(1, "iter 1 rollout (the probe)", precompile_top)
                    episodes, rstats = gather_episodes(procs, local, rstats)
                    first = (position, local, episodes, rstats)
                probe = summarize_episodes(episodes, rollout.group_size)
                lo = procs.share(len(tasks))[0]  # the same first episode of this process's share
                again, _ = collect_episodes(tasks[lo:lo + 1], engine, chat, sandbox, replace(rollout, group_size=1),
                                            tools, seed=rollout_seed(1) + lo * rollout.group_size, first_group_id=lo)
                result["repeatable"] = all(procs.allgather(again[0].ids == local[0].ids))
                if rl.before_eval == "start":
                    result["before"] = eval_before()
                else:  # the engine's params are a copy no update touches (policy_for_engine)
                    start_params = engine.state
                pk = probe.get(f"pass{rollout.group_size}", 0.0)
                result["probe"] = {"pass1": probe["pass1"], f"pass{rollout.group_size}": pk,
                                   **group_signal(episodes)}
                log.log(0, {"check": {**result["verifier_check"], "repeatable": result["repeatable"]},
                            "probe": result["probe"],
                            **({"eval": _eval_scalars(result["before"])} if "before" in result else {})})
                # a reward model scores every episode differently: the verifier's pass@k is no test of signal
                if rl.require_signal and pk == 0.0 and not composer.uses_reward_model:
                    if "before" not in result:
                        result["before"] = eval_before()
                    raise NoSignalError(result,
                        f"the starting policy's pass@{rollout.group_size} on training tasks is 0: every group has "
                        "equal rewards, so group advantages are all 0 and RL has no signal. Start from an SFT "
                        "policy (python -m jaxrl_agent sft) or raise rollout.group_size.")
            # ---- the loop ----
            for it in range(start + 1, rl.iterations + 1):
                if it > start + 1 or first is None:  # iteration 1 is done, or a resumed run (no probe)
                    precompile_top()
                with timer("rollout"):
                    if first is not None:  # sampled before the loop, as the probe
                        (position, local, episodes, rstats), first = first, None
                    else:
                        if ahead is not None:  # sampled by the previous policy while its update ran
                            position, future = ahead
                            local, rstats = future.result()
                        else:
                            position, _, local, rstats = sample_iteration(it, f"iter {it} rollout")
                        ahead = None
                        episodes, rstats = gather_episodes(procs, local, rstats)
                if pool is not None and it < rl.iterations:  # the next rollout overlaps this update
                    nxt = data.next()
                    ahead = (data.position(), pool.submit(rollout_share, nxt, it + 1, engine_version))
                if rewards.pairs_out:  # preference data for `rm-train`, from the verifier's outcomes
                    from jaxrl_agent.agent.preference_pairs import pairs_from_groups, save_preference_pairs

                    if pairs := pairs_from_groups(local, seed=it):  # process p > 0: its own file
                        path = rewards.pairs_out + (f".process{procs.index}" if procs.index else "")
                        save_preference_pairs(path, pairs, append=True)
                with timer("reward"):
                    scored, reward_metrics = composer(local)
                kept, dropped = trainable(scored, rollout)
                counts = procs.allgather(len(kept))
                if rl.shuffle_rewards and sum(counts):  # one permutation of the whole batch's rewards
                    everyone = procs.concat([e.reward for e in kept])  # not `rewards`: that is the RewardConfig
                    perm = np.random.default_rng([rl.seed, it]).permutation(len(everyone))
                    mine = perm[sum(counts[: procs.index]):][: len(kept)]
                    kept = [replace(e, reward=everyone[j]) for e, j in zip(kept, mine)]
                version = int(state.step)
                stale = [version - e.info["policy_version"] for e in episodes]
                metrics = {"rollout": {**_rollout_scalars(episodes, rstats), "staleness_mean": float(np.mean(stale)),
                                       "staleness_max": int(max(stale))},
                           "reward": reward_metrics, "dropped": procs.sum(dropped)}
                if sum(counts):
                    with timer("train"):
                        batch = local_batch(kept, traj, procs)
                        state, tmetrics = ts(state, sh.shard_local_batch(batch, ts.mesh))
                        metrics["train"] = {k: float(v.addressable_data(0)) for k, v in tmetrics.items()}  # replicated
                        policy = policy_for_engine(ts, state)  # a collective: every process, every update
                if ahead is not None:
                    with timer("rollout_wait"):  # the engine is the thread's until its rollout ends
                        ahead[1].exception()
                if sum(counts):
                    engine.update_params(policy)
                    engine_version = int(state.step)
                if rl.eval_every and it % rl.eval_every == 0 and it != rl.iterations:
                    with timer("eval"):
                        ev = evaluate(eval_tasks, engine, chat, sandbox, rollout, tools, rl.eval_samples,
                                      seed=rl.seed + 11, show_progress=show_progress, description=f"eval @ {it}",
                                      procs=procs)[0]
                    metrics["eval"] = _eval_scalars(ev)
                    keep_best(it, ev)
                metrics["time"] = {**timer.seconds, "compile": compile_seconds()}
                if sandbox.memo is not None:  # so far, all processes: calls executed / answered by an identical one
                    metrics["sandbox"] = procs.sum({"calls_run": sandbox.memo.runs, "calls_shared": sandbox.memo.hits})
                result["iterations"].append(log.log(it, metrics))
                if on_iteration is not None:
                    on_iteration(it, result["iterations"][-1])
                if show_progress and procs.is_main:
                    r = metrics["rollout"]
                    rm = (f"  rm {reward_metrics['reward_model_mean']:+.3f}" if composer.uses_reward_model else "")
                    print(f"iter {it:3d}  reward {r['reward_mean']:.3f}{rm}  mixed groups {r['mixed_group_share']:.2f}"
                          f"  turns {r['mean_turns']:.1f}  loss {metrics.get('train', {}).get('loss', float('nan')):+.4f}"
                          + (f"  held-out pass@1 {metrics['eval']['pass1']:.3f}" if "eval" in metrics else ""))
                if ckpt.should_save(it) and it != rl.iterations:  # the last: after its evaluation (keep_best)
                    save(it, position)
                last_done, done_position = it, position
            result["after"] = evaluate(eval_tasks, engine, chat, sandbox, rollout, tools, rl.eval_samples,
                                       seed=rl.seed + 11, show_progress=show_progress, description="eval after",
                                       procs=procs)[0]
            log.log(rl.iterations, {"eval_final": _eval_scalars(result["after"])})
            keep_best(rl.iterations, result["after"])
            save(rl.iterations, position)
            export_hf(ts, state, model.config, os.path.join(rl.run_dir, "policy"), tokenizer=tokenizer,
                      write=procs.is_main)
            if start_params is not None:  # rl.before_eval="end": the starting policy, evaluated now
                engine.update_params(start_params)
                result["before"] = eval_before()
                log.log(rl.iterations, {"eval_before": _eval_scalars(result["before"])})
        except KeyboardInterrupt:
            if ahead is not None:  # let the thread finish with the sandbox before it closes
                ahead[1].exception()
            if last_done > 0:  # the state as it is, under the last completed iteration's number
                save(last_done, done_position)  # an interrupted iteration's tasks are not skipped
            print(f"interrupted: checkpoint saved in {ckpt.cfg.directory}; rerun with --resume to continue")
            result["interrupted"] = True
        finally:
            ts.stop_precompiling()  # buckets never reached are not compiled on the way out
            if pool is not None:
                pool.shutdown(wait=True)
            ckpt.close()
            log.close()
    result["state"], result["train_step"] = state, ts
    return result


def _reward_model(rewards: RewardConfig, given, traj: TrajectoryConfig):
    """The frozen scorer the reward config asks for: `given`, or loaded from its path."""
    if rewards.source == "verifier" or given is not None:
        return given
    if not rewards.reward_model_path:
        raise ValueError(f"rewards.source={rewards.source!r} needs rewards.reward_model_path (a directory written by "
                         "`python -m jaxrl_agent rm-train`)")
    from jaxrl_agent.agent.reward_model import RewardModel, load_reward_model

    return RewardModel(load_reward_model(rewards.reward_model_path), traj, batch_size=rewards.score_batch_size)


def _eval_scalars(summary: dict) -> dict:
    keep = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    keep["behaviour"] = {k: v for k, v in summary["behaviour"].items() if not isinstance(v, dict)}
    keep["failure_layers"] = summary["behaviour"]["failure_layers"]
    return keep


def _rollout_scalars(episodes, stats: dict) -> dict:
    beh = [e.info["behaviour"] for e in episodes]
    n = max(len(episodes), 1)
    calls: dict[str, int] = {}
    for b in beh:
        for k, v in b["tool_calls"].items():
            calls[k] = calls.get(k, 0) + v
    return {
        **group_signal(episodes),
        "success": sum(e.reward >= 1.0 for e in episodes) / n,
        "mean_turns": sum(b["turns"] for b in beh) / n,
        "tool_calls_per_episode": {k: v / n for k, v in calls.items()},
        "interface_errors_per_episode": sum(b["interface_errors"] for b in beh) / n,
        "tool_errors_per_episode": sum(b["tool_errors"] for b in beh) / n,
        "terminations": {k: v / n for k, v in stats["terminations"].items()},
        "mean_tokens": stats["tokens_total"] / n,
        "sampled_tokens_per_s": stats["sampled_tokens_per_s"],
        "seconds": {"sampling": stats["seconds_sampling"], "tools": stats["seconds_tools"],
                    "verify": stats["seconds_verify"], "total": stats["seconds_total"]},
    }
