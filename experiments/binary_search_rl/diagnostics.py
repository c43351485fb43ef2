"""Teacher-forced next-action accuracy: which of a policy's actions go wrong, tool by tool.

Pass rates say how often a policy solves a task, not which of its actions fail. Here the
scripted expert's perfect episodes on fresh held-out instances are fed to every policy
(teacher forcing: each turn conditioned on the expert's history), and an expert turn counts
as reproduced when the policy's argmax gives every one of its tokens: the tool and every
argument. Grouped by tool, this separates the decisions (when to run the tests, when to
submit) and the copies of a listed path (`read_file`) from the copying and fixing inside an edit,
whose turns are tens of tokens that must all be right. An edit turn is split further
(`edit_parts`): its address (`replace_lines`' line numbers, or `str_replace`'s `old` lines),
the text the replaced lines already hold (a copy from the file the policy read) and the text
the edit changes (the fix), so a failing edit says whether the policy cannot find and copy
the line or does not know the fix. A measurement only:
nothing is chosen with it, and its instances are disjoint from the evaluation's and the
learning curve's.
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.edits import EDIT_PARTS, edit_parts, policy_turns
from experiments.binary_search_rl.stage_cache import cached, code_fingerprint, finish, policy_mtime
from experiments.binary_search_rl.stages import chat_format, tools_config
from jaxrl_agent.agent.demonstrations import collect_demonstrations
from jaxrl_agent.agent.policy import load_policy
from jaxrl_agent.env.tasks import generate_tasks, workspace_files
from jaxrl_agent.trajectory import Episode

SEED_OFFSET = 200
"""Instances come from `heldout_instances` with seed `eval.seed + 200` (evaluation uses
`eval.seed`, the learning curve `eval.seed + 100`)."""


def expert_turns(episode: Episode, decode) -> list[tuple[str, list[int]]]:
    """(tool name, token positions) of each policy turn of `episode`; `decode` maps ids to text.

    A turn whose text holds no parseable tool call is named "?"."""
    out = []
    for pos in policy_turns(episode.loss_mask, episode.turn_id):
        text = decode([episode.ids[p] for p in pos])
        try:
            name = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])["name"]
        except (IndexError, ValueError, KeyError, TypeError):
            name = "?"
        out.append((name, pos))
    return out


def turn_accuracy(episodes: list[Episode], predict, decode, max_len: int = 1024,
                  files: list[dict[str, str]] | None = None) -> dict:
    """Per tool: expert turns, share reproduced exactly by `predict`, and token accuracy.

    Args:
      episodes: expert episodes (ids, loss_mask, turn_id).
      predict: int32 `[B, T]` ids, int32 `[B, T]` mask -> int `[B, T]` argmax next-token ids.
      decode: ids -> text (the tokenizer's).
      max_len: T; turns reaching past it are not scored.
      files: per episode, its task's files before any edit; with them, edit turns are also
        scored by part (`edit_parts`).
    Returns:
      {tool: {"turns", "exact", "token_accuracy", "tokens_per_turn"}} plus "all" over every turn,
      and with `files` "edit_parts": {part: {"turns" (holding that part), "tokens",
      "token_accuracy", "turns_all_right", "first_error_at"}} for the parts of `EDIT_PARTS` the
      edits hold; "first_error_at" counts the wrong parts by the index of their first wrong
      token (0, 1, 2, 3 or later): an address wrong at its first token is a wrong line chosen,
      not a miscopied one; and "edit_first_wrong": over the edit turns not reproduced, the part
      of each one's first wrong token ("by_part": past it, a sampled turn would already have
      left the expert's) and, where that is the tool's name, the text the policy's argmax
      wanted there instead ("tool_wanted": e.g. "run" for run_tests, a decision, not an edit);
      and "edit_by_place": per place of the edit in its episode ("1" the first edit, "2" the
      second, ...), {"turns", "tool_right", "arguments_right"}: shares whose tool name, and whose
      every other token (address, copy, fix, JSON), is right. The tool at an edit turn is a
      decision (fix the second bug now, or run the tests first: DESIGN §9b's "fixing one bug of
      two"); the arguments are basic behaviour, whatever the tool's token was.
    """
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # turns, exact, tokens, right
    parts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # the same per part of an edit turn
    first_error: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    first_wrong: dict[str, int] = defaultdict(int)  # failed edit turns by the part of their first wrong token
    wanted: dict[str, int] = defaultdict(int)  # ... and what the argmax wanted where that was the tool name
    by_place: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # edit turns, tool right, arguments right
    for start in range(0, len(episodes), 8):
        batch = episodes[start:start + 8]
        ids = np.zeros((len(batch), max_len), np.int32)
        mask = np.zeros((len(batch), max_len), np.int32)
        for b, e in enumerate(batch):
            n = min(len(e.ids), max_len)
            ids[b, :n], mask[b, :n] = e.ids[:n], 1
        pred = np.asarray(predict(ids, mask))
        for b, e in enumerate(batch):
            edits_seen = 0
            for name, pos in expert_turns(e, decode):
                if pos[-1] >= max_len:
                    continue
                right = [int(pred[b, p - 1]) == e.ids[p] for p in pos]
                for key in (name, "all"):
                    c = counts[key]
                    c[0], c[1], c[2], c[3] = c[0] + 1, c[1] + all(right), c[2] + len(right), c[3] + sum(right)
                kinds = edit_parts([e.ids[p] for p in pos], decode, files[start + b]) if files else None
                if kinds:
                    edits_seen += 1
                    c = by_place[edits_seen]
                    c[0] += 1
                    c[1] += all(r for r, k in zip(right, kinds) if k == "tool")
                    c[2] += all(r for r, k in zip(right, kinds) if k != "tool")
                if kinds and not all(right):
                    at = right.index(False)
                    first_wrong[kinds[at]] += 1
                    if kinds[at] == "tool":
                        instead = decode([int(pred[b, pos[at] - 1])])
                        wanted[instead.strip() or repr(instead)] += 1
                for part in EDIT_PARTS if kinds else ():
                    mine = [r for r, k in zip(right, kinds) if k == part]
                    if mine:
                        c = parts[part]
                        c[0], c[1], c[2], c[3] = c[0] + 1, c[1] + all(mine), c[2] + len(mine), c[3] + sum(mine)
                        if not all(mine):  # where in the part the first error falls: 0, 1, 2, 3 = later
                            first_error[part][min(mine.index(False), 3)] += 1
    out = {k: {"turns": c[0], "exact": c[1] / c[0], "token_accuracy": c[3] / c[2], "tokens_per_turn": c[2] / c[0]}
           for k, c in counts.items()}
    if files:
        out["edit_parts"] = {k: {"turns": c[0], "tokens": c[2], "token_accuracy": c[3] / c[2],
                                 "turns_all_right": c[1] / c[0], "first_error_at": first_error[k]}
                             for k, c in parts.items()}
        out["edit_first_wrong"] = {"turns": sum(first_wrong.values()), "by_part": dict(first_wrong),
                                   "tool_wanted": dict(wanted)}
        out["edit_by_place"] = {str(k): {"turns": c[0], "tool_right": c[1] / c[0], "arguments_right": c[2] / c[0]}
                                for k, c in sorted(by_place.items())}
    return out


def _predictor(policy_dir: str):
    model, tok = load_policy(policy_dir)
    graphdef, state = nnx.split(model)

    @jax.jit
    def argmax_next(state, ids, mask):
        m = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return jnp.argmax(m(ids, pos, mask), axis=-1)

    return (lambda ids, mask: argmax_next(state, ids, mask)), tok.decode


def teacher_forced(cfg: StudyConfig, policies: dict[str, str], sandbox) -> dict:
    """`turn_accuracy` of each policy (name -> policy dir) on `cfg.diagnose.tasks` expert
    episodes; cached under `<work_dir>/diagnose` like the other stages."""
    stamp = {"diagnose": asdict(cfg.diagnose), "eval_seed": cfg.eval.seed, "test_timeout_s": cfg.test_timeout_s,
             "policies": {name: [path, policy_mtime(path)] for name, path in policies.items()},
             "code": code_fingerprint(sys.modules[__name__])}
    done = cached(cfg, "diagnose", stamp)
    if done is not None:
        return done
    t0 = time.time()
    tasks = generate_tasks("heldout_instances", cfg.diagnose.tasks, cfg.eval.seed + SEED_OFFSET)
    episodes = collect_demonstrations(tasks, sandbox, chat_format(cfg), ("perfect",), threads=cfg.sandbox_workers,
                        tool_cfg=tools_config(cfg))
    result: dict = {"tasks": len(tasks), "expert_success": sum(e.reward >= 1 for e in episodes) / len(episodes),
                    "per_policy": {}}
    files = [workspace_files(t) for t in tasks]  # one perfect episode per task, in task order
    for name, path in policies.items():
        predict, decode = _predictor(path)
        result["per_policy"][name] = turn_accuracy(episodes, predict, decode, files=files)
    result["seconds"] = time.time() - t0
    return finish(cfg, "diagnose", stamp, result)


def diagnostics_markdown(diag: dict, labels: dict[str, str]) -> str:
    """The table of `teacher_forced`'s result: exact-turn share (token accuracy) per tool."""
    seen = {t for per_tool in diag["per_policy"].values() for t in per_tool}
    tools = [t for t in ("list_files", "read_file", "replace_lines", "str_replace", "run_tests", "submit", "all")
             if t in seen]
    rows = ["| policy (teacher-forced, " + f"{diag['tasks']} held-out expert episodes) | "
            + " | ".join(f"`{t}`" if t != "all" else "all turns" for t in tools) + " |",
            "|---" * (len(tools) + 1) + "|"]
    for name, per_tool in diag["per_policy"].items():
        cells = [f"{per_tool[t]['exact']:.2f} ({per_tool[t]['token_accuracy']:.3f})" if t in per_tool else "-"
                 for t in tools]
        rows.append(f"| {labels.get(name, name)} | " + " | ".join(cells) + " |")
    edits = {n: p["edit_parts"] for n, p in diag["per_policy"].items() if p.get("edit_parts")}
    if edits:
        shown = [k for k in EDIT_PARTS if any(k in p for p in edits.values())]
        heads = {"tool": "tool name", "lines": "line numbers", "old": "`old` (the lines copied to address the edit)",
                 "copy": "text copied from the file", "fix": "the fix", "other": "path, JSON, end"}
        rows += ["", "| edit turns by part: all of the part right (token accuracy) | "
                 + " | ".join(heads[k] for k in shown) + " |", "|---" * (len(shown) + 1) + "|"]
        for name, p in edits.items():
            rows.append(f"| {labels.get(name, name)} | " + " | ".join(
                f"{p[k]['turns_all_right']:.2f} ({p[k]['token_accuracy']:.3f})" if k in p else "-" for k in shown) + " |")
        wrong = {n: p["edit_first_wrong"] for n, p in diag["per_policy"].items() if p.get("edit_first_wrong")}
        if wrong:
            shown = [k for k in EDIT_PARTS if k in shown or any(k in w["by_part"] for w in wrong.values())]
            rows += ["", "| edit turns not reproduced: the part of the first wrong token | turns | "
                     + " | ".join(heads[k] for k in shown) + " | the argmax at a wrong tool name |",
                     "|---" * (len(shown) + 3) + "|"]
            for name, w in wrong.items():
                instead = ", ".join(f"{t} {c}" for t, c in sorted(w["tool_wanted"].items(), key=lambda x: -x[1])) or "-"
                rows.append(f"| {labels.get(name, name)} | {w['turns']} | "
                            + " | ".join(str(w["by_part"].get(k, 0)) for k in shown) + f" | {instead} |")
        places = {n: p["edit_by_place"] for n, p in diag["per_policy"].items() if p.get("edit_by_place")}
        if places:
            keys = sorted({k for p in places.values() for k in p}, key=int)
            rows += ["", "| edit turns by their place in the episode: tool name right / every other token right "
                     "(turns) | " + " | ".join(f"edit {k}" for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
            for name, p in places.items():
                rows.append(f"| {labels.get(name, name)} | " + " | ".join(
                    f"{p[k]['tool_right']:.2f} / {p[k]['arguments_right']:.2f} ({p[k]['turns']})" if k in p else "-"
                    for k in keys) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.binary_search_rl.diagnostics NAME=POLICY_DIR ... [--work_dir=DIR]`:
    the teacher-forced table of the given policies, on the study's held-out expert episodes."""
    import argparse
    from dataclasses import replace

    from jaxrl_agent.env.sandbox import Sandbox

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("policies", nargs="+", help="name=policy_dir")
    p.add_argument("--work_dir", default="runs/diagnose", help="where the result is cached (<work_dir>/diagnose)")
    args = p.parse_args(argv)
    bad = [x for x in args.policies if "=" not in x]
    if bad:
        p.error(f"expected name=policy_dir, got {bad}")
    cfg = replace(StudyConfig(), work_dir=args.work_dir)
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        diag = teacher_forced(cfg, dict(x.split("=", 1) for x in args.policies), sandbox)
    print(diagnostics_markdown(diag, {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
