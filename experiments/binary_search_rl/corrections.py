"""Expert corrections from the policy's own states (DAgger-style data for SFT) (HOST).

Demonstrations show the expert's states only: every edit in them is right, so the SFT policy
never sees what follows its own mistakes (a correct line rewritten, a site left, the same edit
or test run again) and, once off the expert's path, it loops until the token budget runs out
(`sites.py` on validation instances). Here the policy's own sampled episodes on fresh training
instances are replayed through the real tools; at its first call the expert would not make in
that state, the episode branches: the policy's turns before it stay as context (out of the
loss) and the expert finishes from the workspace as the policy left it (every remaining
difference from the reference, wrong lines the policy wrote included, then the tests, then
submit), in the loss. Ross, Gordon & Bagnell, "A Reduction of Imitation Learning and
Structured Prediction to No-Regret Online Learning" (AISTATS 2011): training on the learner's
own state distribution, labelled by the expert.

    policy episodes (train split) --replay--> first call not `accepted` --expert finishes--> Episode
      loss: 0 on the prompt, observations and the policy's turns; 1 on the expert's turns

What the expert accepts in a state (`accepted`): list the files first, then read the source; then
any of: run the tests (not twice without a change between), read the source again (only after
it changed), one of the edits left between the current file and the reference, and submit
once the file is the reference. An episode whose every call is accepted needs no correction.
"""
from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from experiments.binary_search_rl.edits import policy_turns
from jaxrl_agent.agent.rollout import episode_prompt
from jaxrl_agent.chat_template import IM_END
from jaxrl_agent.config import SYSTEM_PROMPT
from jaxrl_agent.env.expert import plan_edits
from jaxrl_agent.env.tasks import Task, workspace_files
from jaxrl_agent.env.tools import TOOL_SETS, ToolConfig, Tools, ToolSession, create_workspaces, format_tool_call
from jaxrl_agent.tokenizer import ChatFormat, EpisodeBuilder
from jaxrl_agent.trajectory import Episode


@dataclass
class _State:
    """What the expert's acceptance depends on, updated after each accepted call."""

    path: str
    listed: bool = False
    read: bool = False  # read since the file last changed
    ever_read: bool = False
    tested: bool = False  # tests run since the file last changed
    ever_tested: bool = False
    edited: bool = False
    turns: list[tuple[str, str]] = field(default_factory=list)  # (call text, observation)


def accepted(state: _State, current: str, reference: str, tool_style: str, decisions: bool = True) -> set[str]:
    """The call texts the expert would accept as its next one (see the module docstring);
    without `decisions`, also any `run_tests` and `submit` once the source was read: the
    policy's decisions stand and only its basic behaviour (paths, reads, edits, the call
    format) is corrected, so RL still has the decisions to learn (DESIGN §9b)."""
    if not state.listed:
        return {format_tool_call("list_files")}
    read = format_tool_call("read_file", {"path": state.path})
    if not state.ever_read:
        return {read}
    ok = set() if state.read else {read}
    if not state.tested:
        ok.add(format_tool_call("run_tests"))
    name, edits = plan_edits(current, reference, state.path, tool_style)
    ok |= {format_tool_call(name, e) for e in edits}
    if current == reference or not decisions:
        ok.add(format_tool_call("submit"))
    if not decisions:
        ok.add(format_tool_call("run_tests"))
    return ok


def correct(task: Task, calls: list[str], chat: ChatFormat, sandbox, tool_cfg: ToolConfig, workspace: str,
            *, system_prompt: str = SYSTEM_PROMPT, decisions: bool = True) -> tuple[Episode | None, dict]:
    """The corrected episode of one policy episode (its calls' texts, in order) on `task`, or
    None when every call is accepted (or the task has no single source file to correct);
    with what happened: {"branch": index of the first call not accepted, "policy_call": the
    tool it named ("?" when unparsed)}. `workspace`: a fresh copy of the task's files;
    `decisions`: as `accepted`."""
    refs = sorted(task.reference_files)
    if len(refs) != 1:
        return None, {"skipped": "not one source file"}
    path = refs[0]
    reference = task.reference_files[path]
    session = ToolSession(Tools(workspace, sorted(task.dev_tests), sandbox, tool_cfg), tool_cfg,
                          TOOL_SETS[chat.tool_style])
    state = _State(path)

    def current() -> str:
        with open(os.path.join(workspace, path), encoding="utf-8") as f:
            return f.read()

    def act(text: str) -> str:
        before = current()
        res = session.step(text)
        state.turns.append((text, res.observation))
        name = res.call.name if res.call is not None else None
        changed = current() != before
        state.listed |= name == "list_files"
        state.read = (state.read and not changed) or name == "read_file"
        state.ever_read |= name == "read_file"
        state.tested = (state.tested and not changed) or name == "run_tests"
        state.ever_tested |= name == "run_tests"
        state.edited |= changed
        return res.observation

    branch = None
    for k, text in enumerate(calls):
        if session.termination is not None:
            break
        if text not in accepted(state, current(), reference, chat.tool_style, decisions):
            branch = k
            break
        act(text)
    if branch is None:
        return None, {}
    parsed = calls[branch].split('"name": "', 1)
    info = {"branch": branch, "policy_call": parsed[1].split('"', 1)[0] if len(parsed) == 2 else "?"}
    # the expert finishes from here: as `run_expert`'s "perfect" style would from this state
    if not state.listed:
        act(format_tool_call("list_files"))
    if not state.ever_read:
        act(format_tool_call("read_file", {"path": path}))
    if not state.ever_tested and not state.edited:
        act(format_tool_call("run_tests"))
    edited = False
    while session.termination is None:
        name, todo = plan_edits(current(), reference, path, chat.tool_style)
        if not todo:
            break
        act(format_tool_call(name, todo[0]))
        if not state.turns[-1][1].startswith("Edited"):
            return None, {**info, "skipped": "an expert edit did not apply"}
        edited = True
    if session.termination is None and (edited or not state.tested):
        act(format_tool_call("run_tests"))
    if session.termination is None:
        act(format_tool_call("submit"))
    if session.termination != "submitted" or current() != reference:
        return None, {**info, "skipped": f"the expert could not finish ({session.termination})"}
    builder = EpisodeBuilder(chat, episode_prompt(task, system_prompt), chat.tool_schemas)
    for k, (text, observation) in enumerate(state.turns):
        ids = chat.tokenizer.encode(text + IM_END)
        builder.append_sampled(ids, [0.0] * len(ids))
        if k + 1 < len(state.turns):
            builder.append_observation(observation)
    ep = Episode.from_builder(builder, reward=1.0, group_id=0, termination="submitted",
                              info={"task_id": task.task_id, "template": str(task.metadata.get("template", "")),
                                    "style": "correction", **info})
    for pos in policy_turns(ep.loss_mask, ep.turn_id)[:branch]:  # the policy's own turns: context only
        for p in pos:
            ep.loss_mask[p] = 0
    return ep, info


def episode_calls(episode: Episode, decode) -> list[str]:
    """The call texts of a sampled episode's policy turns (the stop token dropped)."""
    out = []
    for pos in policy_turns(episode.loss_mask, episode.turn_id):
        text = decode([episode.ids[p] for p in pos])
        out.append(text[: -len(IM_END)] if text.endswith(IM_END) else text)
    return out


def collect_corrections(tasks: list[Task], calls: list[list[str]], chat: ChatFormat, sandbox, *,
                        tool_cfg: ToolConfig = ToolConfig(), max_tokens: int = 1024,
                        threads: int = 2, decisions: bool = True) -> tuple[list[Episode], dict]:
    """`correct` over (task, its policy episode's calls) pairs; corrected episodes longer than
    `max_tokens` are dropped; `decisions` as `accepted`. Returns the episodes (in pair order) and counts: pairs,
    corrected, accepted throughout, skipped, too long, and the corrected ones by the tool the
    policy named at the branch."""
    with tempfile.TemporaryDirectory(prefix="jxa-corrections-") as root:
        def one(i: int):
            ws = create_workspaces(workspace_files(tasks[i]), os.path.join(root, str(i)), 1)[0]
            return correct(tasks[i], calls[i], chat, sandbox, tool_cfg, ws, decisions=decisions)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            results = list(pool.map(one, range(len(tasks))))
    out, by_call = [], {}
    stats = {"pairs": len(tasks), "corrected": 0, "all_accepted": 0, "skipped": 0, "too_long": 0}
    for ep, info in results:
        if ep is None:
            stats["skipped" if "skipped" in info else "all_accepted"] += 1
        elif len(ep) > max_tokens:
            stats["too_long"] += 1
        else:
            out.append(ep)
            stats["corrected"] += 1
            by_call[info["policy_call"]] = by_call.get(info["policy_call"], 0) + 1
    stats["branch_call"] = dict(sorted(by_call.items(), key=lambda kv: -kv[1]))
    return out, stats


SEED_OFFSET = 300
"""Correction instances: `generate_tasks("train", n, seed + 300)`, disjoint from the
demonstrations (seed), the drills (+100), the validation instances (+5555)."""


def correction_round(cfg, policy: str, demos: list[Episode], *, tasks: int, steps: int, learning_rate: float,
                     repeat: int, name: str, sandbox, decisions: bool = True) -> dict:
    """One DAgger round: `policy` samples one episode on each of `tasks` fresh training
    instances (half with made-up file names, as the demonstrations), the failures' corrections
    (repeated `repeat` times) join `demos`, and `policy` is fine-tuned on them for `steps`
    (`stages._fit`, exported to `<work_dir>/<name>/policy`); `decisions` as `accepted`."""
    from experiments.binary_search_rl import stages
    from experiments.binary_search_rl.drills import module_renamed_tasks
    from jaxrl_agent.env.tasks import generate_tasks
    from jaxrl_agent.loops.evaluate import evaluate

    d = cfg.demos
    seed = cfg.seed + SEED_OFFSET
    pool = module_renamed_tasks(generate_tasks("train", tasks, seed), seed, made_up=True, share=d.made_up_modules,
                                words=d.word_modules)
    engine, chat = stages.sampler(cfg, policy, seed)
    summary, eps = evaluate(pool, engine, chat, sandbox, stages.rollout_config(cfg), stages.tools_config(cfg), 1,
                            seed=seed, show_progress=False)
    by_id = {t.task_id: t for t in pool}
    failed = [e for e in eps if e.reward < 1.0]
    fixes, stats = collect_corrections([by_id[e.info["task_id"]] for e in failed],
                                       [episode_calls(e, chat.tokenizer.decode) for e in failed], chat, sandbox,
                                       tool_cfg=stages.tools_config(cfg), threads=cfg.sandbox_workers,
                                       decisions=decisions)
    print(f"[{name}] policy pass@1 {summary['pass1']:.3f} on {len(pool)} training instances; corrections {stats}",
          flush=True)
    fit = stages._fit(cfg, name, list(demos) + fixes * repeat, steps=steps, batch_size=cfg.sft.batch_size,
                      learning_rate=learning_rate, init=policy)
    return {"sampled_pass1": summary["pass1"], "corrections": stats, **fit}


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.binary_search_rl.corrections --policy=DIR --demos=JSONL`: one
    correction round from an SFT policy (then `sites.py` on the policy it writes)."""
    import argparse
    import json
    from dataclasses import replace

    from experiments.binary_search_rl.config import StudyConfig
    from jaxrl_agent.env.sandbox import Sandbox
    from jaxrl_agent.trajectory import load_episodes

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--policy", required=True, help="the SFT policy (HF directory)")
    p.add_argument("--demos", required=True, help="the study's demonstrations.jsonl (<work_dir>/demos/)")
    p.add_argument("--tasks", type=int, default=512, help="fresh training instances the policy samples")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--repeat", type=int, default=1, help="copies of each correction in the data")
    p.add_argument("--decisions", choices=("true", "false"), default="true",
                   help="false: correct basic behaviour only; the policy's run_tests / submit decisions stand")
    p.add_argument("--name", default="corrections")
    p.add_argument("--work_dir", default="runs/corrections")
    args = p.parse_args(argv)
    for flag in ("tasks", "steps", "repeat"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if not os.path.isfile(os.path.join(args.policy, "config.json")):
        p.error(f"--policy={args.policy} is not an HF policy directory (no config.json)")
    if not os.path.isfile(args.demos):
        p.error(f"--demos={args.demos} does not exist: run the study's demonstration stage first")
    cfg = replace(StudyConfig(), work_dir=args.work_dir)
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        out = correction_round(cfg, args.policy, load_episodes(args.demos), tasks=args.tasks, steps=args.steps,
                               learning_rate=args.learning_rate, repeat=args.repeat, name=args.name, sandbox=sandbox,
                               decisions=args.decisions == "true")
    out.pop("nll", None)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
