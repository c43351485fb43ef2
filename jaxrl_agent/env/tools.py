"""Agent tools over a per-episode workspace and the episode session (HOST).

The call format, schemas and parser live in `tool_calls.py` (re-exported here). The
harness answers a parsed call with the tool's result text (wrapped in <tool_response> by the
chat layer, not here). One call per assistant message. Results are short, deterministic
plain text: tiny models are trained on them.

Every bad input becomes an error text and the episode goes on (DESIGN §7): malformed JSON,
unknown tool, missing/extra/mistyped arguments, oversized arguments, paths outside the
workspace, an `old` text that is missing or not unique, a line range outside the file.

`read_file` prints `N|line` (no space after the bar): the line's text then splits into the
same pre-tokens as inside a JSON string argument (`"` + the same indentation), so
`replace_lines`'s `text` copies the observation token for token. Interface errors (the call never
reached a tool: `ParseError.kind`) count towards `ToolConfig.max_parse_errors` in a row,
which ends the episode with termination "parse_error_limit".
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

# Re-exported: callers import the whole tool API from here.
from jaxrl_agent.env.tool_calls import (EDIT_TOOLS, TOOL_DESCRIPTIONS, TOOL_SCHEMAS, TOOL_SETS,  # noqa: F401
                                        ParseError, ToolCall, format_tool_call, parse_tool_call,
                                        tool_schemas)


@dataclass(frozen=True)
class ToolConfig:
    """Limits of the tool layer (token limits are the rollout's)."""

    max_turns: int = 12
    """Assistant messages before the episode ends with "max_turns"."""
    max_parse_errors: int = 3
    """Interface errors in a row before the episode ends with "parse_error_limit"."""
    max_arg_chars: int = 4000
    """Longest accepted string argument (an oversized one is an interface error)."""
    max_output_chars: int = 2000
    """Tool results longer than this are truncated."""
    test_timeout_s: float = 0.5
    """Per-test limit of `run_tests` (a looping test fails alone, quickly; the task family's
    tests take milliseconds, and a looping bug costs this much per test in every rollout)."""
    run_timeout_s: float = 10.0
    """Wall limit of one `run_tests` call."""
    report_unchanged: bool = False
    """An edit that changes nothing (the lines already hold its text) answers "No change: ..."
    instead of the usual "Edited ..." (either way nothing is written and `StepResult.changed`
    is False). Off by default: the study's policies were trained and measured with "Edited";
    with it on, GRPO from the shipped SFT policy did no better on validation (study README,
    "Budget-ended failures")."""


# ---- workspace helpers ----


class ToolError(Exception):
    """A tool was called correctly but could not act (file missing, old not unique, ...)."""


def resolve(workspace: str, path: str) -> str:
    """Absolute path of a regular file inside `workspace`; ToolError if it is not one."""
    if not path or "\x00" in path or "\\" in path:
        raise ToolError(f"Error: invalid path {path[:80]!r}.")
    if os.path.isabs(path) or ".." in path.split("/"):
        raise ToolError(f"Error: path {path[:80]!r} is outside the repository "
                        "(use a relative path without '..').")
    root = os.path.realpath(workspace)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ToolError(f"Error: path {path[:80]!r} is outside the repository.")
    if not os.path.isfile(full):
        raise ToolError(f"Error: no file {path[:80]!r}. Use list_files to see the files.")
    return full


def list_workspace(workspace: str) -> list[str]:
    """Sorted relative paths of the regular files (caches skipped, symlinks not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(workspace):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".pytest_cache")
                             and not os.path.islink(os.path.join(dirpath, d)))
        for f in filenames:
            p = os.path.join(dirpath, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(os.path.relpath(p, workspace).replace(os.sep, "/"))
    return sorted(out)


def write_atomic(path: str, text: str) -> None:
    """Write via a temporary file and rename: readers never see half a file, and a
    hard-linked copy (cheap per-episode workspaces) is unlinked rather than shared."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def create_workspaces(files: dict[str, str], root: str, n: int) -> list[str]:
    """`n` independent workspaces with `files` under `root` (a hard-link farm).

    The files are written once into `root/base`; each `root/ep{i}` hard-links them, so a
    GRPO group of episodes fans out in microseconds. Tools write atomically, so an edit in
    one episode replaces that episode's link and never shows in the others.
    """
    base = os.path.join(root, "base")
    for rel, text in files.items():
        p = os.path.join(base, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    dirs = []
    for i in range(n):
        d = os.path.join(root, f"ep{i}")
        for rel in files:
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            os.link(os.path.join(base, rel), os.path.join(d, rel))
        dirs.append(d)
    return dirs


# ---- tool implementations ----


@dataclass
class ToolResult:
    text: str
    """What the model sees (already truncated)."""
    ok: bool = True
    """False when the tool reported an error (behaviour level: missing file, bad `old`)."""
    done: bool = False
    termination: str | None = None
    """"submitted" or "sandbox_error" when the tool ends the episode."""
    changed: bool | None = None
    """For an edit that was carried out: whether the file's text changed (False: the lines
    already held the text, nothing was written). None for every other tool and for errors."""


def _unchanged(path: str, what: str) -> ToolResult:
    """The observation of an edit whose text is already there (`ToolConfig.report_unchanged`),
    where "Edited" hides that the file is the one the last test run saw (a policy rewriting a
    correct line in a loop; `rewards.turn_outcomes` labels the turn either way)."""
    return ToolResult(f"No change: {path} {what}; the file is as it was.", changed=False)


class Tools:
    """The DESIGN §7 tools over one episode's workspace directory."""

    def __init__(self, workspace: str, test_files: list[str], sandbox=None,
                 cfg: ToolConfig = ToolConfig()):
        self.workspace, self.test_files, self.sandbox, self.cfg = (
            workspace, list(test_files), sandbox, cfg)

    def __call__(self, call: ToolCall) -> ToolResult:
        try:
            res = getattr(self, "_" + call.name)(**call.arguments)
        except ToolError as e:
            res = ToolResult(str(e), ok=False)
        except (OSError, UnicodeDecodeError) as e:
            res = ToolResult(f"Error: {type(e).__name__}: {e}", ok=False)
        if len(res.text) > self.cfg.max_output_chars:
            res.text = res.text[: self.cfg.max_output_chars] + "\n...(output truncated)"
        return res

    def _list_files(self) -> ToolResult:
        return ToolResult("\n".join(list_workspace(self.workspace)) or "(no files)")

    def _read_file(self, path: str, start_line: int | None = None,
                   end_line: int | None = None) -> ToolResult:
        with open(resolve(self.workspace, path), encoding="utf-8") as f:
            lines = f.read().splitlines()
        start = 1 if start_line is None else start_line
        end = len(lines) if end_line is None else min(end_line, len(lines))
        if start < 1 or (lines and start > len(lines)) or end < start - 1:
            raise ToolError(f"Error: bad line range {start}..{end_line}; {path} has "
                            f"{len(lines)} lines.")
        if not lines:
            return ToolResult(f"({path} is empty)")
        return ToolResult(numbered(lines, start, end))

    def _replace_lines(self, path: str, start: int, end: int, text: str) -> ToolResult:
        full = resolve(self.workspace, path)
        with open(full, encoding="utf-8") as f:
            old = f.read()
        lines = old.splitlines()
        if not (1 <= start <= len(lines) + 1 and start - 1 <= end <= len(lines)):
            raise ToolError(f"Error: bad line range {start}..{end}; {path} has {len(lines)} lines "
                            "(start..end inclusive; end = start - 1 inserts before start).")
        new = text[:-1].split("\n") if text.endswith("\n") else text.split("\n")
        new = [] if text == "" else _strip_numbers(new, start)
        changed = lines[start - 1:end] != new
        lines[start - 1:end] = new
        if changed:
            write_atomic(full, "\n".join(lines) + ("\n" if lines and (old.endswith("\n") or not old) else ""))
        elif self.cfg.report_unchanged:
            return _unchanged(path, f"lines {start}-{end} already read" + (" this" if new else " nothing"))
        if not new:
            return ToolResult(f"Edited {path}: deleted lines {start}-{end}.", changed=changed)
        shown = min(len(new), 10)
        return ToolResult(f"Edited {path}:\n" + numbered(lines, start, start + shown - 1), changed=changed)

    def _str_replace(self, path: str, old: str, new: str) -> ToolResult:
        full = resolve(self.workspace, path)
        if not old:
            raise ToolError("Error: old must not be empty.")
        with open(full, encoding="utf-8") as f:
            text = f.read()
        count = text.count(old)
        if count == 0:
            raise ToolError(f"Error: old text not found in {path}. Copy it exactly from "
                            "read_file (without the line numbers).")
        if count > 1:
            raise ToolError(f"Error: old text occurs {count} times in {path}; include more "
                            "surrounding lines to make it unique.")
        line = text[: text.index(old)].count("\n") + 1
        changed = new != old
        if changed:
            write_atomic(full, text.replace(old, new, 1))
        elif self.cfg.report_unchanged:
            return _unchanged(path, f"the text at line {line} already reads new")
        return ToolResult(f"Edited {path} at line {line}.", changed=changed)

    def _run_tests(self) -> ToolResult:
        if self.sandbox is None:
            raise ToolError("Error: run_tests is not available in this environment.")
        res = self.sandbox.run(self.workspace, [sys.executable, "-m", "pytest", "-q",
                                                *self.test_files],
                               timeout_s=self.cfg.run_timeout_s,
                               test_timeout_s=self.cfg.test_timeout_s)
        if res.error:
            return ToolResult(f"Error: the test run failed ({res.error}).", ok=False, done=True,
                              termination="sandbox_error")
        return ToolResult(summarize_tests(res))

    def _submit(self) -> ToolResult:
        return ToolResult("Submitted.", done=True, termination="submitted")


_NUMBER = re.compile(r"(\d+)\|")


def _strip_numbers(new: list[str], start: int) -> list[str]:
    """`replace_lines` text may carry read_file's `N|` prefixes (`10|    x = 1`): then every
    line has one, numbered start, start + 1, ..., and they are dropped; a line of code never
    starts with `N|`, so plain text is left as it is."""
    found = [_NUMBER.match(line) for line in new]
    if not any(found):
        return new
    want = list(range(start, start + len(new)))
    if not all(found) or [int(m.group(1)) for m in found] != want:
        raise ToolError(f"Error: numbered text must number its lines {want[0]}..{want[-1]} as read_file "
                        "does (`N|line`), or carry no numbers at all.")
    return [line[m.end():] for line, m in zip(new, found)]


def number_text(text: str, start: int) -> str:
    """`replace_lines` text with read_file's `N|` prefixes, numbered from `start`."""
    return "\n".join(f"{start + k}|{line}" for k, line in enumerate(text.split("\n")))


def numbered(lines: list[str], start: int, end: int) -> str:
    """Lines start..end (1-based, inclusive) as `read_file` shows them: `N|line`."""
    return "\n".join(f"{i}|{lines[i - 1]}" for i in range(start, end + 1))


def summarize_tests(res) -> str:
    """Counts and the first failure of a sandboxed pytest run, in a few lines."""
    if res.timed_out:
        return "Tests timed out (the whole run took too long)."
    recs = [r for r in (res.tests or []) if r.get("event") == "test"]
    counts: dict[str, int] = {}
    for r in recs:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    if not recs:
        tail = (res.stdout or res.stderr).strip().splitlines()[-3:]
        return "No tests ran." + ("\n" + "\n".join(tail) if tail else "")
    order = ("passed", "failed", "error", "skipped")
    head = ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))
    bad = [r for r in recs if r["outcome"] in ("failed", "error")]
    if not bad:
        return head + "."
    first = bad[0]
    name = first["id"].split("::")[-1]
    label = "ERROR collecting" if first["when"] == "collect" else "FAILED"
    return f"{head}.\n{label} {name}: {first['message'].strip()[:400]}"


# ---- one episode ----


@dataclass
class StepResult:
    observation: str
    """Tool result (or interface error) text for the model."""
    done: bool
    termination: str | None
    call: ToolCall | None
    error: ParseError | None = None
    tool_ok: bool = True
    changed: bool | None = None
    """`ToolResult.changed`: whether an edit changed the file (None: not an edit)."""


@dataclass
class ToolSession:
    """Turns assistant messages into tool calls and results, enforcing the episode limits.

    `step(text)` parses one assistant message, runs the tool, and reports whether the
    episode ended and why ("submitted", "max_turns", "parse_error_limit", "sandbox_error").
    """

    tools: Tools
    cfg: ToolConfig = ToolConfig()
    tool_names: tuple[str, ...] | None = None
    """The tools offered (`TOOL_SETS[style]`); None: every known tool."""
    turns: int = 0
    parse_errors_in_row: int = 0
    termination: str | None = None
    history: list = field(default_factory=list)

    def step(self, text: str) -> StepResult:
        if self.termination is not None:
            raise RuntimeError(f"episode already ended ({self.termination})")
        self.turns += 1
        call = parse_tool_call(text, self.cfg.max_arg_chars, self.tool_names)
        if isinstance(call, ParseError):
            self.parse_errors_in_row += 1
            done = self.parse_errors_in_row >= self.cfg.max_parse_errors
            out = StepResult(call.message, done, "parse_error_limit" if done else None, None,
                             call, tool_ok=False)
        else:
            self.parse_errors_in_row = 0
            res = self.tools(call)
            out = StepResult(res.text, res.done, res.termination, call, None, res.ok, res.changed)
        if not out.done and self.turns >= self.cfg.max_turns:
            out.done, out.termination = True, "max_turns"
        self.termination = out.termination if out.done else None
        self.history.append((text, out))
        return out
