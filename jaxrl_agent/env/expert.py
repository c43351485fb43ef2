"""Scripted demonstrator: solves tasks through the real tools and tool-call text (HOST).

`run_expert(task, workspace, sandbox, style)` plays one episode exactly as a policy
would: every assistant message is one `format_tool_call(...)` text, every observation is
the real tool result from a `ToolSession`, and the final workspace is scored by the
verifier. The transcript is therefore a valid SFT episode.

The expert knows the fix (it diffs the workspace against `task.reference_files`). It edits
in either tool style (`tool_style`): "full" with `str_replace(path, old, new)`, "short" with
`replace_lines(path, start, end, text)`, one changed line per call, "lines" with `str_replace`
of whole lines (indentation included, as read_file prints them). Its styles add the
imperfections real demonstrations have, each a *decision* (the edits it does make are right
except where a style says otherwise):
- "perfect": read, run the tests, fix every bug, run the tests again, submit;
- "skip_tests": read, fix every bug, submit without ever running the tests;
- "first_bug_only": read, run the tests, fix only the first differing line, then submit;
- "wrong_first_edit": make a plausible but wrong first edit, run the tests, and recover
  (fix everything, re-run, submit) only if the run shows a failure;
- "stop_after_failure": the same wrong first edit and test run, then submit despite the
  failing run;
- "rerun_tests": run the tests twice without editing in between, then submit unfixed;
- "recover_after_failing_run": fix the first bug, run the tests and, only if they fail, fix
  the rest, re-run and submit (the recovery of "wrong_first_edit" without the wrong edit);
- "stop_after_failing_run": fix the first bug, run the tests, submit whatever they say (the
  stop of "stop_after_failure" without the wrong edit: progress made, then a decision).

The two wrong-edit styles demonstrate an edit that fixes nothing, which the failure-layer
classifier (`evaluation.episode_behaviour`) calls basic, not a decision; the last two styles
make the same decisions with every edit right.

Measure the success rate per style: `python -m jaxrl_agent.env.expert --n 40`.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field

from jaxrl_agent.env.tasks import Task, generate_tasks, workspace_files
from jaxrl_agent.env.tools import (TOOL_SETS, ToolConfig, Tools, ToolSession, create_workspaces,
                                   format_tool_call, number_text)
from jaxrl_agent.env.verifier import verify

STYLES = ("perfect", "skip_tests", "first_bug_only", "wrong_first_edit", "stop_after_failure", "rerun_tests",
          "recover_after_failing_run", "stop_after_failing_run")


@dataclass
class Transcript:
    """One demonstrated episode."""

    task_id: str
    style: str
    turns: list[tuple[str, str]] = field(default_factory=list)
    """(assistant text = one tool call, tool result text) per turn."""
    termination: str | None = None
    reward: float = 0.0
    verify_info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- edit planning ----


def _line_edits(current: str, reference: str) -> list[tuple[int, int, str]]:
    """(start, end, text) `replace_lines` calls turning `current` into `reference`, in file
    order: one call per changed line where a block keeps its line count (the task family's
    bugs always do), one call for the whole block otherwise (end = start - 1 inserts)."""
    cur, ref = current.splitlines(), reference.splitlines()
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=cur, b=ref, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        if i2 - i1 == j2 - j1:
            out += [(i1 + k + 1, i1 + k + 1, ref[j1 + k]) for k in range(i2 - i1) if cur[i1 + k] != ref[j1 + k]]
        else:
            out.append((i1 + 1, i2, "\n".join(ref[j1:j2])))
    return out


def plan_edits(current: str, reference: str, path: str, tool_style: str) -> tuple[str, list[dict]]:
    """(tool name, arguments of each remaining correct edit, first one first) turning `path`'s
    `current` text into `reference` with the edit tool of `tool_style`."""
    if tool_style in ("full", "lines"):
        pairs = _edits(current, reference, whole_lines=tool_style == "lines")
        return "str_replace", [dict(path=path, old=o, new=n) for o, n in pairs]
    return "replace_lines", [dict(path=path, start=a, end=b, text=t) for a, b, t in _line_edits(current, reference)]


def _edits(current: str, reference: str, whole_lines: bool = False) -> list[tuple[str, str]]:
    """(old, new) str_replace pairs turning `current` into `reference`, one per differing
    block, each `old` grown with context lines until it is unique in `current`. With
    `whole_lines` both are whole lines as read_file prints them (indentation kept, no final
    newline); otherwise `_trim`med to the shortest faithful edit."""
    cur, ref = current.splitlines(keepends=True), reference.splitlines(keepends=True)
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=cur, b=ref, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        lo, hi = i1, i2
        if lo == hi:  # pure insertion: anchor on a neighbouring line
            lo, hi = (lo - 1, hi) if lo > 0 else (lo, hi + 1)
        while True:
            old = "".join(cur[lo:hi])
            new = "".join(cur[lo:i1]) + "".join(ref[j1:j2]) + "".join(cur[i2:hi])
            if whole_lines and old.endswith("\n") and new.endswith("\n"):
                old, new = old[:-1], new[:-1]
            if current.count(old) == 1 or (lo == 0 and hi == len(cur)):
                break
            lo, hi = max(lo - 1, 0), min(hi + 1, len(cur))
        out.append((old, new) if whole_lines else _trim(old, new, current))
    return out


def _trim(old: str, new: str, current: str) -> tuple[str, str]:
    """Drop the shared leading indentation and trailing newline of (old, new) while `old`
    stays unique: the shortest faithful edit is the one a small model can copy reliably."""
    k = 0
    while k < min(len(old), len(new)) and old[k] == new[k] and old[k] in " \t":
        k += 1
    j = 1 if old.endswith("\n") and new.endswith("\n") else 0
    o, n = old[k:len(old) - j], new[k:len(new) - j]
    if o and o != n and current.count(o) == 1:
        return o, n
    return old, new


_MUTATIONS = ((" + 1", " + 2"), (" - 1", " - 2"), ("<=", "<"), (">=", ">"), (" < ", " <= "),
              (" > ", " >= "), ("[:", "[1:"), ("0", "1"))


def _wrong(new: str, old: str) -> str | None:
    """A plausible but wrong variant of the correct text `new` (None if none found)."""
    for a, b in _MUTATIONS:
        if a in new:
            cand = new.replace(a, b, 1)
            if cand not in (new, old):
                return cand
    return None


# ---- one episode ----


def run_expert(task: Task, workspace: str, sandbox, style: str = "perfect", cfg: ToolConfig = ToolConfig(),
               tool_style: str = "full", judge: bool = True) -> Transcript:
    """Play one episode on `workspace` (a fresh copy of task.files + task.dev_tests), editing
    with the tools of `tool_style` ("full": str_replace, "short": replace_lines, "numbered":
    replace_lines with read_file's `N|` prefixes in its text, "lines": str_replace of whole
    lines); with
    `judge`, the verifier scores the final workspace (`reward`, `verify_info`)."""
    if style not in STYLES:
        raise ValueError(f"unknown expert style {style!r}; expected one of {STYLES}")
    session = ToolSession(Tools(workspace, sorted(task.dev_tests), sandbox, cfg), cfg, TOOL_SETS[tool_style])
    tr = Transcript(task.task_id, style)
    short = tool_style in ("short", "numbered")  # replace_lines edits

    def act(name: str, **args) -> str:
        if session.termination is not None:
            return ""
        text = format_tool_call(name, args)
        res = session.step(text)
        tr.turns.append((text, res.observation))
        return res.observation

    def current(path: str) -> str:
        with open(os.path.join(workspace, path), encoding="utf-8") as f:
            return f.read()

    def plan(path: str) -> list[dict]:
        return plan_edits(current(path), task.reference_files[path], path, tool_style)[1]

    def edit(args: dict) -> bool:
        if tool_style == "numbered":
            args = dict(args, text=number_text(args["text"], args["start"]))
        act("replace_lines" if short else "str_replace", **args)
        return bool(tr.turns) and tr.turns[-1][1].startswith("Edited")

    def fix(limit: int | None = None) -> None:
        """Apply the first remaining edit, re-plan on the new text, repeat (`limit` edits)."""
        done = 0
        for path in sorted(task.reference_files):
            while limit is None or done < limit:
                todo = plan(path)
                if not todo or session.termination is not None:
                    break
                done += 1
                if not edit(todo[0]):
                    return  # the edit did not apply: stop rather than loop

    def wrong_edit() -> bool:
        """A plausible but wrong version of the first correct edit; False if none exists."""
        todo = plan(sorted(task.reference_files)[0])
        if not todo:
            return False
        args = dict(todo[0])
        key = "text" if short else "new"
        old = current(args["path"]).splitlines()[args["start"] - 1] if short else args["old"]
        wrong = _wrong(args[key], old)
        if wrong is None:
            return False
        args[key] = wrong
        return edit(args)

    def failing(result: str) -> bool:
        return "failed" in result or "error" in result or "timed out" in result

    # ---- look around: always list first, so the paths read are copied from the listing (a
    # coin flip here was a first turn no policy could predict; and a policy that skips the
    # listing guesses the generator's file names on tasks written by hand) ----
    act("list_files")
    for path in sorted(task.reference_files):
        act("read_file", path=path)
    if style != "skip_tests":
        act("run_tests")
    # ---- edit (or not) ----
    if style in ("wrong_first_edit", "stop_after_failure"):
        if wrong_edit():
            result = act("run_tests")
            if style == "wrong_first_edit" and failing(result):
                fix()  # recovery: the failing run says the edit was wrong
        elif style == "wrong_first_edit":
            fix()
    elif style == "rerun_tests":
        act("run_tests")  # the same code, the same result: a wasted turn, then giving up
    elif style == "first_bug_only":
        fix(limit=1)
    elif style in ("recover_after_failing_run", "stop_after_failing_run"):
        fix(limit=1)
        if tr.turns[-1][1].startswith("Edited"):
            result = act("run_tests")
            if style == "recover_after_failing_run" and failing(result):
                fix()
    else:
        fix()
    if style in ("perfect", "wrong_first_edit", "recover_after_failing_run") and session.termination is None and \
            tr.turns and tr.turns[-1][1].startswith("Edited"):
        act("run_tests")
    act("submit")
    # ---- score ----
    tr.termination = session.termination
    if judge:
        vr = verify(task, workspace, sandbox)
        tr.reward, tr.verify_info = vr.reward, vr.info
    return tr


def measure(tasks: list[Task], sandbox, styles=STYLES,
            cfg: ToolConfig = ToolConfig(), threads: int | None = None,
            tool_style: str = "full") -> dict[str, dict]:
    """Success rate, mean turns and terminations per style over `tasks`.

    Episodes run in `threads` threads (default: one per sandbox worker); the expert is
    deterministic, so the result does not depend on scheduling.
    """
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or getattr(getattr(sandbox, "config", None), "num_workers", 1)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for style in styles:
            def one(i: int) -> Transcript:
                ws = create_workspaces(workspace_files(tasks[i]),
                                       os.path.join(root, style, str(i)), 1)[0]
                return run_expert(tasks[i], ws, sandbox, style, cfg, tool_style)

            with ThreadPoolExecutor(threads) as pool:
                trs = list(pool.map(one, range(len(tasks))))
            terms: dict = {}
            for tr in trs:
                terms[tr.termination] = terms.get(tr.termination, 0) + 1
            n = max(len(trs), 1)
            out[style] = dict(success_rate=sum(t.reward for t in trs) / n, n=len(trs),
                              mean_turns=sum(len(t.turns) for t in trs) / n, terminations=terms)
    return out


def main(argv: list[str] | None = None) -> None:
    from jaxrl_agent.env.sandbox import Sandbox

    p = argparse.ArgumentParser(description="Expert success rate per imperfection style.")
    p.add_argument("--split", default="train")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tool-style", default="full", choices=tuple(TOOL_SETS))
    p.add_argument("--out", default=None, help="optional JSON output path")
    args = p.parse_args(argv)
    tasks = generate_tasks(args.split, args.n, args.seed)
    with Sandbox(num_workers=args.workers, timeout_s=20) as sb:
        res = measure(tasks, sb, tool_style=args.tool_style)
    print(f"{'style':<18} {'success':>8} {'turns':>6}  terminations")
    for style, r in res.items():
        print(f"{style:<18} {r['success_rate']:>8.3f} {r['mean_turns']:>6.1f}  {r['terminations']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(split=args.split, n=args.n, seed=args.seed, results=res), f, indent=2)


if __name__ == "__main__":
    main()
