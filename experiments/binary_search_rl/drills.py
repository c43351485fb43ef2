"""Edit drills: cheap, copy-heavy episodes that pretrain the tiny policy before SFT.

A tiny policy trained only on a few hundred demonstrations learns the episode format but not
the one skill every edit needs: copying the exact text of a line it just read into the edit
(`replace_lines`' line number and `text` in the short tool style, `str_replace`'s `old` in the
full one, and the path from the instruction into `path`). It writes identifiers it saw in
other tasks instead, so its edits fail on any instance it has not memorised.

A drill is an episode in the agent's own format on a fresh task instance: `read_file` of the
source, then copies of other lines of the file changed the way a plausible wrong edit would
be and immediately undone, then the expert's fix edits, then `submit`. Every
observation is the real tool result (read_file / str_replace act on a real workspace); no
tests run and nothing is verified, so a drill costs milliseconds, and thousands of distinct
instances (with their randomised identifiers) are affordable. That many instances cannot be
memorised: the loss only falls by copying. The drills play the part pretraining plays for a
real LLM; the SFT baselines and RL all start from the same drilled model.

The templates draw identifiers from small pools (4-5 names per role), so a policy can also
lower the loss by guessing a pool's name. `random_name_tasks` re-instantiates a share of
the drill instances with made-up identifiers and module names (syllable words never seen
in the pools), where only a copy is right.
"""
from __future__ import annotations

import keyword
import os
import random
import tempfile

from jaxrl_agent.demonstrations import transcript_to_episode
from jaxrl_agent.env.expert import Transcript, _wrong, plan_edits
from jaxrl_agent.env.tasks import Task, make_instance, workspace_files
from jaxrl_agent.env.templates import TEMPLATES
from jaxrl_agent.env.tools import (TOOL_SETS, ToolConfig, Tools, ToolSession, create_workspaces, format_tool_call,
                                   number_text)
from jaxrl_agent.tokenizer import ChatFormat
from jaxrl_agent.trajectory import Episode


def _copyable_lines(text: str) -> list[tuple[int, str]]:
    """(1-based number, line) of the code lines a drill may copy: non-empty, not a comment or
    docstring, no quote or backslash (JSON would escape them), stripped text unique in `text`
    (so a `str_replace` of it is valid too)."""
    out = []
    for k, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s and not s.startswith(('"""', "#")) and not {'"', "\\"} & set(line) and text.count(s) == 1:
            out.append((k, line))
    return out


_SYLLABLES = ("ba", "ko", "ri", "tu", "me", "sa", "vi", "lo", "dra", "pen", "qui", "zor",
              "fal", "mun", "tek", "wis", "gor", "yel", "nap", "hix")


def _made_up(rng: random.Random, taken: set[str]) -> str:
    """A fresh identifier: 2-3 syllables, sometimes two words joined by '_'."""
    while True:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 2, 3))))
        if rng.random() < 0.3:
            word += "_" + "".join(rng.choice(_SYLLABLES) for _ in range(2))
        if word not in taken and not keyword.iskeyword(word) and word not in dir(__builtins__):
            taken.add(word)
            return word


def random_name_tasks(tasks: list[Task], share: float, seed: int) -> list[Task]:
    """`tasks` with a `share` of them re-made from their template with made-up identifiers
    and module name (same bugs drawn afresh); deterministic in (seed, index)."""
    out = []
    for i, task in enumerate(tasks):
        rng = random.Random(f"names|{seed}|{i}")
        if rng.random() >= share:
            out.append(task)
            continue
        tpl = TEMPLATES[task.metadata["template"]]
        taken: set[str] = set()
        names = {role: _made_up(rng, taken) for role in tpl.names}
        out.append(make_instance(tpl, rng, split="train", seed=seed, names=names, module=_made_up(rng, taken)))
    return out


def drill_transcript(task: Task, workspace: str, rng: random.Random, extra_edits: int = 2,
                     tool_style: str = "short") -> Transcript:
    """One drill on `workspace` (a fresh copy of the task's files); see the module docstring."""
    # read + change/restore pairs + at most 4 fixes + submit: room past the agent's turn limit
    cfg = ToolConfig(max_turns=max(ToolConfig().max_turns, 2 * extra_edits + 6))
    session = ToolSession(Tools(workspace, sorted(task.dev_tests), None, cfg), cfg, TOOL_SETS[tool_style])
    tr = Transcript(task.task_id, "drill")

    def act(name: str, **args) -> str:
        if tool_style == "numbered" and name == "replace_lines":
            args = dict(args, text=number_text(args["text"], args["start"]))
        text = format_tool_call(name, args)
        res = session.step(text)
        tr.turns.append((text, res.observation))
        return res.observation

    path = task.metadata["source_file"]
    act("read_file", path=path)
    current = task.files[path]
    copyable = _copyable_lines(current)
    for k, line in rng.sample(copyable, min(extra_edits, len(copyable))):
        wrong = _wrong(line, line)
        if wrong is None or current.count(wrong.strip()) or wrong.strip() in line:
            continue
        if tool_style != "full":
            act("replace_lines", path=path, start=k, end=k, text=wrong)  # a plausible change ...
            act("replace_lines", path=path, start=k, end=k, text=line)  # ... copied back exactly
        else:
            act("str_replace", path=path, old=line.strip(), new=wrong.strip())
            act("str_replace", path=path, old=wrong.strip(), new=line.strip())
    for _ in range(4):  # the expert's fix, re-planned after each edit as the expert does
        with open(os.path.join(workspace, path), encoding="utf-8") as f:
            now = f.read()
        tool, plan = plan_edits(now, task.reference_files[path], path, tool_style)
        if not plan:
            break
        act(tool, **plan[0])
    act("submit")
    return tr


def make_drills(tasks: list[Task], chat: ChatFormat, *, seed: int, extra_edits: int = 2,
                system_prompt: str | None = None) -> list[Episode]:
    """One drill episode per task (in order), in `chat`'s tool style; deterministic in
    (seed, task index)."""
    kw = {} if system_prompt is None else {"system_prompt": system_prompt}
    out = []
    with tempfile.TemporaryDirectory(prefix="jxa-drills-") as root:
        for i, task in enumerate(tasks):
            ws = create_workspaces(workspace_files(task), os.path.join(root, str(i)), 1)[0]
            tr = drill_transcript(task, ws, random.Random(f"{seed}|{i}"), extra_edits, chat.tool_style)
            out.append(transcript_to_episode(tr, task, chat, group_id=i, **kw))
    return out
