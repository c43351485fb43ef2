"""Edit drills: cheap, copy-heavy episodes that pretrain the tiny policy before SFT.

A tiny policy trained only on a few hundred demonstrations learns the episode format but not
the one skill every edit needs: copying the exact text of a line it just read into
`str_replace`'s `old` (and the path from the instruction into `path`). It writes identifiers
it saw in other tasks instead, so its edits fail on any instance it has not memorised.

A drill is an episode in the agent's own format on a fresh task instance: `read_file` of the
source, then the expert's fix edits, each preceded by copies of other lines of the file
changed the way a plausible wrong edit would be and immediately undone, then `submit`. Every
observation is the real tool result (read_file / str_replace act on a real workspace); no
tests run and nothing is verified, so a drill costs milliseconds, and thousands of distinct
instances (with their randomised identifiers) are affordable. That many instances cannot be
memorised: the loss only falls by copying. The drills play the part pretraining plays for a
real LLM; the SFT baselines and RL all start from the same drilled model.
"""
from __future__ import annotations

import os
import random
import tempfile

from jaxrl_agent.demonstrations import transcript_to_episode
from jaxrl_agent.env.expert import Transcript, _edits, _wrong
from jaxrl_agent.env.tasks import Task, workspace_files
from jaxrl_agent.env.tools import ToolConfig, Tools, ToolSession, create_workspaces, format_tool_call
from jaxrl_agent.tokenizer import ChatFormat
from jaxrl_agent.trajectory import Episode


def _copyable_lines(text: str) -> list[str]:
    """Stripped non-empty lines that occur exactly once in `text` (valid `old` strings)."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith(('"""', "#")) and text.count(s) == 1:
            out.append(s)
    return out


def drill_transcript(task: Task, workspace: str, rng: random.Random, extra_edits: int = 2) -> Transcript:
    """One drill on `workspace` (a fresh copy of the task's files); see the module docstring."""
    session = ToolSession(Tools(workspace, sorted(task.dev_tests), None, ToolConfig()), ToolConfig())
    tr = Transcript(task.task_id, "drill")

    def act(name: str, **args) -> str:
        text = format_tool_call(name, args)
        res = session.step(text)
        tr.turns.append((text, res.observation))
        return res.observation

    path = task.metadata["source_file"]
    act("read_file", path=path)
    current = task.files[path]
    for line in rng.sample(_copyable_lines(current), min(extra_edits, len(_copyable_lines(current)))):
        wrong = _wrong(line, line)
        if wrong is None or current.count(wrong) or wrong in line:
            continue
        act("str_replace", path=path, old=line, new=wrong)  # a plausible change ...
        act("str_replace", path=path, old=wrong, new=line)  # ... copied back exactly
    for _ in range(4):  # the expert's fix, re-planned after each edit as the expert does
        plan = _edits(open(os.path.join(workspace, path), encoding="utf-8").read(), task.reference_files[path])
        if not plan:
            break
        act("str_replace", path=path, old=plan[0][0], new=plan[0][1])
    act("submit")
    return tr


def make_drills(tasks: list[Task], chat: ChatFormat, *, seed: int, extra_edits: int = 2,
                system_prompt: str | None = None) -> list[Episode]:
    """One drill episode per task (in order); deterministic in (seed, task index)."""
    kw = {} if system_prompt is None else {"system_prompt": system_prompt}
    out = []
    with tempfile.TemporaryDirectory(prefix="jxa-drills-") as root:
        for i, task in enumerate(tasks):
            ws = create_workspaces(workspace_files(task), os.path.join(root, str(i)), 1)[0]
            tr = drill_transcript(task, ws, random.Random(f"{seed}|{i}"), extra_edits)
            out.append(transcript_to_episode(tr, task, chat, group_id=i, **kw))
    return out
