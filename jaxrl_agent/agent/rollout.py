"""HOST: the agent loop (DESIGN §2): sample -> parse -> tools -> observe -> ... -> verify.

`collect_episodes` keeps up to B episodes in flight on a `SamplingEngine` (continuous
batching: a finished row is refilled with the next pending episode at once). Per turn:

    begin_turn(rows ready to speak)           then advance(decode_chunk) until the row's
                                              turn ends: device, every row mid-turn decodes
                                              together, and a row whose turn ended leaves at
                                              the chunk boundary (the others go on)
      -> append sampled ids verbatim          loss_mask 1, the sampler's policy log-probs
      -> ToolSession.step(text) in a thread   parse + run the tool (sandbox for run_tests)
      -> append the rendered observation      loss_mask 0, prefilled into that row only
    ... until submit / max turns / token budget / parse-error limit / sandbox error
      -> verify(task, workspace) in a thread  independent judge -> reward (only a submitted
                                              episode can earn it; the others score 0)

Episodes come back with the verifier's reward and, in `info["turn_outcomes"]`, one label per
turn (ok / interface_error / tool_error / repeated_test / unchanged_edit) for optional per-turn shaping
(agent/rewards.py); what the update trains on is composed later (loops/rl.py, rewards.RewardComposer).

Tool calls and verifications run in a thread pool, so while some rows wait on the sandbox
the engine keeps decoding the others. A crash in a tool or the verifier costs that episode
(termination "sandbox_error", dropped from the update by `RolloutConfig.drop_terminations`),
never the run.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from jaxrl_agent.agent.evaluation import bug_outcomes, bugs_fixed, episode_behaviour
from jaxrl_agent.agent.rewards import turn_outcomes
from jaxrl_agent.config import RolloutConfig
from jaxrl_agent.env.tasks import Task, workspace_files
from jaxrl_agent.env.tools import StepResult, ToolConfig, Tools, ToolSession, create_workspaces
from jaxrl_agent.env.verifier import verify
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder
from jaxrl_agent.trajectory import Episode


@dataclass
class _Live:
    """An episode occupying an engine row."""

    key: tuple[int, int]  # (task index, member of the group)
    task: Task
    group_id: int
    builder: EpisodeBuilder
    session: ToolSession
    workspace: str
    seed: int
    waiting: Future | None = None  # the tool call in flight
    speaking: bool = False  # in a turn on the engine (begin_turn .. the advance that ends it)
    termination: str | None = None


@dataclass
class RolloutStats:
    """Where the time went and how many tokens moved (one `collect_episodes` call)."""

    seconds_sampling: float = 0.0
    seconds_tools: float = 0.0
    seconds_verify: float = 0.0
    seconds_total: float = 0.0
    tokens_sampled: int = 0
    tokens_total: int = 0
    engine_calls: int = 0  # `advance` calls (each a chunk of decode steps on every row mid-turn)
    episodes: int = 0
    terminations: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["sampled_tokens_per_s"] = self.tokens_sampled / max(self.seconds_sampling, 1e-9)
        return d


def episode_prompt(task: Task, system_prompt: str) -> list[dict]:
    """The opening messages of an episode on `task`."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": task.instruction}]


def collect_episodes(
    tasks: Sequence[Task],
    engine: SamplingEngine,
    chat: ChatFormat,
    sandbox,
    cfg: RolloutConfig,
    tool_cfg: ToolConfig = ToolConfig(),
    *,
    seed: int = 0,
    first_group_id: int = 0,
    progress=None,
    on_episode=None,
) -> tuple[list[Episode], RolloutStats]:
    """Run `cfg.group_size` episodes on every task and return them with timing stats.

    Args:
      tasks: the tasks of this batch; task i's episodes get group id `first_group_id + i`.
      engine: a SamplingEngine whose cache holds `cfg.max_total_tokens` per row.
      chat: chat format (tokenizer + tool style); sandbox: an open `env.sandbox.Sandbox`.
      seed: episode seeds are `seed + k` for the k-th episode, so a run is repeatable.
      progress: optional callable(n_done, n_total) for a progress bar.
      on_episode: optional callable(episode), called as each episode ends (jobs that write
        results as they go, so a late failure keeps what was measured).
    Returns:
      (episodes in task order, G per task, with `info` holding task id, behaviour and
      verifier details; stats).
    """
    if engine.config.cache_size != cfg.max_total_tokens:
        # The cache is the token budget: a row stops sampling exactly where the episode must end.
        raise ValueError(f"engine cache_size={engine.config.cache_size} must equal rollout "
                         f"max_total_tokens={cfg.max_total_tokens}")
    if engine.config.max_new_tokens < cfg.max_tokens_per_turn:
        raise ValueError(f"engine max_new_tokens={engine.config.max_new_tokens} < max_tokens_per_turn={cfg.max_tokens_per_turn}")
    if not cfg.verify_test_timeout_s > 0:  # 0 would switch the per-test limit off
        raise ValueError(f"rollout verify_test_timeout_s={cfg.verify_test_timeout_s} must be > 0 seconds "
                         f"(the verifier's per-test CPU limit; default 1.0)")
    G = cfg.group_size
    pending = [(i, g) for i in range(len(tasks)) for g in range(G)]  # (task index, member)
    results: dict[tuple[int, int], Episode] = {}
    stats = RolloutStats()
    t_start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="jxa-rollout-")
    workspaces = {}  # task index -> G workspace dirs (hard-link farm, made on first use)
    live: dict[int, _Live] = {}  # engine row -> the episode sampling in it
    verifying: dict[Future, _Live] = {}  # submitted episodes, their rows already refilled
    tool_seconds = [0.0, 0.0]  # [tools, verify], summed over threads

    def timed(slot: int, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            tool_seconds[slot] += time.perf_counter() - t0

    def start(row: int) -> None:
        i, g = pending.pop(0)
        task = tasks[i]
        if i not in workspaces:
            workspaces[i] = create_workspaces(workspace_files(task), os.path.join(root, f"t{i}"), G)
        tools = Tools(workspaces[i][g], sorted(task.dev_tests), sandbox, tool_cfg)
        builder = EpisodeBuilder(chat, episode_prompt(task, cfg.system_prompt), chat.tool_schemas)
        ep_seed = seed + i * G + g
        live[row] = _Live((i, g), task, first_group_id + i, builder, ToolSession(tools, tool_cfg, chat.tool_names),
                          workspaces[i][g], ep_seed)
        engine.start_episode(row, builder.ids, seed=ep_seed)

    def finish(row: int, termination: str) -> None:
        """Free the row at once; a submitted workspace is verified in the background.

        Only a submission can earn the reward: an episode that ran out of turns or tokens
        (or never made a valid call) scores 0 whatever its workspace holds, so the policy
        is never paid for not deciding to stop."""
        ep = live.pop(row)
        engine.end_episode(row)
        ep.termination = termination
        if termination == "submitted":
            verifying[pool.submit(timed, 1, _safe_verify, ep.task, ep.workspace, sandbox,
                                  cfg.verify_test_timeout_s)] = ep
        else:
            close(ep, (0.0, {"reason": "not_submitted"}))

    def close(ep: _Live, verdict) -> None:
        reward, vinfo = verdict
        termination = ep.termination
        if vinfo.get("reason") in ("verifier_crash", "sandbox_error"):
            termination = "sandbox_error"  # the outcome is unknown: not the policy's to learn from
        meta = ep.task.metadata  # free-form in a user's task file: only strings reach the summaries
        final = _final_sources(ep)
        info = {"task_id": ep.task.task_id, "template": str(meta.get("template", "")),
                "split": str(meta.get("split", "")), "verify": vinfo, "seed": ep.seed,
                "behaviour": episode_behaviour(ep.session.history, termination, reward, bugs_fixed(ep.task, final),
                                               bug_outcomes(ep.task, final)),
                "turn_outcomes": turn_outcomes(ep.session.history)}  # per-turn shaping reads these
        episode = Episode.from_builder(ep.builder, reward=reward, group_id=ep.group_id,
                                       termination=termination, info=info)
        if len(episode) > cfg.max_total_tokens:
            # Only a last observation can stick out (it was rendered, then found not to fit):
            # its tokens are loss-masked, so the cut changes nothing the update sees.
            n = cfg.max_total_tokens
            episode.ids, episode.loss_mask = episode.ids[:n], episode.loss_mask[:n]
            episode.sampler_logp, episode.turn_id = episode.sampler_logp[:n], episode.turn_id[:n]
        results[ep.key] = episode
        stats.terminations[termination] = stats.terminations.get(termination, 0) + 1
        if on_episode is not None:
            on_episode(episode)
        if progress is not None:
            progress(len(results), len(tasks) * G)

    with ThreadPoolExecutor(max_workers=cfg.tool_threads) as pool:
        try:
            while pending or live or verifying:
                # ---- refill free rows (continuous batching) ----
                for row in engine.free_rows():
                    if not pending:
                        break
                    start(row)
                # ---- rows ready to speak begin a turn; every row mid-turn decodes a chunk ----
                ready = [r for r, ep in live.items() if ep.waiting is None and not ep.speaking]
                if ready:
                    # Per-row room is the engine's job: a row that reaches the end of its
                    # cache stops with "cache_full" (cache_size >= max_total_tokens).
                    engine.begin_turn(ready, max_new_tokens=cfg.max_tokens_per_turn)
                    for r in ready:
                        live[r].speaking = True
                if any(ep.speaking for ep in live.values()):
                    t0 = time.perf_counter()
                    # A row whose turn ends goes to its tools at once, while the others go on
                    # decoding (chunk 0: whole turns, every row waits for the slowest).
                    turn = engine.advance(cfg.decode_chunk or cfg.max_tokens_per_turn)
                    stats.seconds_sampling += time.perf_counter() - t0
                    stats.engine_calls += 1
                    for r, reason in enumerate(turn.finish_reason):
                        if reason is None:
                            continue
                        ep = live[r]
                        ep.speaking = False
                        ids, logp, _ = turn.row(r)
                        ep.builder.append_sampled(ids, logp, context=len(ep.builder))
                        stats.tokens_sampled += len(ids)
                        if reason == "cache_full" or len(ep.builder) >= cfg.max_total_tokens:
                            finish(r, "max_tokens")
                            continue
                        text = chat.tokenizer.decode(ids)
                        ep.waiting = pool.submit(timed, 0, _safe_step, ep.session, text)
                # ---- collect finished tool calls and verifications ----
                busy = {ep.waiting: r for r, ep in live.items() if ep.waiting is not None}
                if not busy and not verifying:
                    continue
                # Block only when nothing can be decoded (or started) meanwhile.
                can_work = any(ep.waiting is None for ep in live.values()) or (pending and engine.free_rows())
                done, _ = wait([*busy, *verifying], timeout=0 if can_work else None, return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in verifying:
                        close(verifying.pop(fut), fut.result())
                        continue
                    r = busy[fut]
                    ep = live[r]
                    ep.waiting = None
                    step = fut.result()
                    if step.done:
                        finish(r, step.termination)
                        continue
                    obs = ep.builder.append_observation(step.observation)
                    if len(ep.builder) + 1 >= cfg.max_total_tokens:
                        finish(r, "max_tokens")
                        continue
                    engine.append(r, obs)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    stats.seconds_tools, stats.seconds_verify = tool_seconds
    stats.seconds_total = time.perf_counter() - t_start
    episodes = [results[(i, g)] for i in range(len(tasks)) for g in range(G)]
    stats.episodes = len(episodes)
    stats.tokens_total = sum(len(e) for e in episodes)
    return episodes, stats


def _safe_step(session: ToolSession, text: str):
    """ToolSession.step, with any crash of the tool layer turned into a sandbox_error end."""
    try:
        return session.step(text)
    except Exception as e:  # noqa: BLE001 - a broken tool must not kill the run
        session.termination = "sandbox_error"
        return StepResult(f"Error: tool crashed ({type(e).__name__})", True, "sandbox_error", None, None, False)


def _final_sources(ep: _Live) -> dict[str, str]:
    """The task's source files as the episode left them (unreadable ones are skipped)."""
    out = {}
    for rel in ep.task.files:
        try:
            with open(os.path.join(ep.workspace, rel), encoding="utf-8") as f:
                out[rel] = f.read()
        except (OSError, UnicodeDecodeError):
            pass
    return out


def _safe_verify(task: Task, workspace: str, sandbox, test_timeout_s: float) -> tuple[float, dict]:
    try:
        res = verify(task, workspace, sandbox, test_timeout_s=test_timeout_s)
        return float(res.reward), dict(res.info)
    except Exception as e:  # noqa: BLE001 - a verifier crash costs the episode, not the run
        return 0.0, {"reason": "verifier_crash", "detail": f"{type(e).__name__}: {e}"}


def trainable(episodes: Sequence[Episode], cfg: RolloutConfig) -> tuple[list[Episode], dict]:
    """Episodes that enter the update: drop `cfg.drop_terminations`, and (DAPO dynamic
    sampling) groups whose rewards are all equal when `cfg.filter_zero_variance`.

    Returns (kept episodes, counts of what was dropped and why).
    """
    kept = [e for e in episodes if e.termination not in cfg.drop_terminations]
    dropped = {"termination": len(episodes) - len(kept), "zero_variance_groups": 0}
    if cfg.filter_zero_variance:
        by_group: dict[int, list[Episode]] = {}
        for e in kept:
            by_group.setdefault(e.group_id, []).append(e)
        flat = [g for g in by_group.values() if len({e.reward for e in g}) == 1]
        dropped["zero_variance_groups"] = len(flat)
        drop_ids = {id(e) for g in flat for e in g}
        kept = [e for e in kept if id(e) not in drop_ids]
    return kept, dropped


def group_signal(episodes: Sequence[Episode]) -> dict:
    """Share of groups with differing rewards and mean reward: does RL have a signal? (§9b)"""
    by_group: dict[int, list[float]] = {}
    for e in episodes:
        by_group.setdefault(e.group_id, []).append(e.reward)
    mixed = [len(set(r)) > 1 for r in by_group.values()]
    rewards = np.array([e.reward for e in episodes], np.float64)
    return {"groups": len(by_group), "mixed_group_share": float(np.mean(mixed)) if mixed else 0.0,
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0}
