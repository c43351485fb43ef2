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

`whole_transcript_loss` turns the drills into pretraining in the LLM sense: next-token loss on
every token after the shared system prompt, the tool results included. Inside a file an
identifier recurs (`lo` on five lines); after its first occurrence each later one is
predictable only by a look-up in the context, the same content-keyed copy an edit needs. With
the loss on the policy's calls alone that copy is supervised on the few tokens of each call;
on the whole transcript it is supervised on every recurring token of every observation, at
the same compute per step. Measured, it did not help (README at the repository's root, "the
copy stage"); `copy_sequences` did: the copy forms there, and the drills build on it.
"""
from __future__ import annotations

import functools
import keyword
import os
import random
import sys
import tempfile
import zlib
from dataclasses import replace
from typing import Sequence

import numpy as np

from experiments.binary_search_rl.edits import edit_parts, policy_turns
from jaxrl_agent.agent.demonstrations import transcript_to_episode
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


# English-word file names: Python's standard-library module names (offline, real words that a
# user's code also uses), each joined to a second one or to a helper suffix so that no name
# shadows the module itself. The words split in two halves by a hash: drills and
# demonstrations draw from "train", validation instances from "validation". The hand-written
# tasks' module names are never drawn (they are the held-out check).
_SUFFIXES = ("utils", "tools", "helpers", "lib", "core", "ops", "funcs", "data")
_HELD_OUT_NAMES = frozenset({"search_utils", "bisect_tools", "price_book", "timeline", "pagination", "staircase",
                             "playlist", "budget"})


@functools.cache  # one sort per split, not one per name drawn
def _word_list(split: str) -> tuple[str, ...]:
    words = sorted(w for w in sys.stdlib_module_names
                   if w.isalpha() and w.islower() and 3 <= len(w) <= 10 and not keyword.iskeyword(w))
    return tuple(w for w in words if (zlib.crc32(w.encode()) % 4 == 0) == (split == "validation"))


def _word_name(rng: random.Random, split: str = "train") -> str:
    """A file name of English words: `word_suffix` or `word_word` (the comment above `_SUFFIXES`)."""
    words = _word_list(split)
    while True:
        first = rng.choice(words)
        second = rng.choice(_SUFFIXES) if rng.random() < 0.5 else rng.choice(words)
        name = f"{first}_{second}"
        if first != second and name not in _HELD_OUT_NAMES:
            return name


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


def module_renamed_tasks(tasks: list[Task], seed: int, *, made_up: bool, share: float = 1.0,
                         words: float = 0.0, word_split: str = "train") -> list[Task]:
    """Each task (a seeded `share` of them; the others unchanged) re-made from its template
    with its own seeded draws, the module named from a separate stream: a made-up word
    (`made_up`; a seeded `words` share of those English words instead, `_word_name` from
    the `word_split` half) or a name from the template's pool. The two lists pair up: same identifiers,
    bugs and tests, only the file name differs (unless a made-up name collides with an
    identifier and make_instance draws again). Measures whether a policy copies the listed
    file name or writes one it memorised; as training data (`made_up_modules` of the drills
    and the demonstrations), makes a path a copy."""
    out = []
    for i, task in enumerate(tasks):
        if share < 1.0 and random.Random(f"module-share|{seed}|{i}").random() >= share:
            out.append(task)
            continue
        tpl = TEMPLATES[task.metadata["template"]]
        name_rng = random.Random(f"module|{seed}|{i}")
        if not made_up:
            module = name_rng.choice(tpl.modules)
        elif words and random.Random(f"module-words|{seed}|{i}").random() < words:
            module = _word_name(name_rng, word_split)
        else:
            module = _made_up(name_rng, set())
        out.append(make_instance(tpl, random.Random(f"instance|{seed}|{i}"), split="train", seed=seed, module=module))
    return out


def drill_transcript(task: Task, workspace: str, rng: random.Random, extra_edits: int = 2,
                     tool_style: str = "short", changes: list[int] | None = None) -> Transcript:
    """One drill on `workspace` (a fresh copy of the task's files); see the module docstring.
    `changes`, when given, receives the indices (in `tr.turns`) of the change edits, whose
    line was drawn at random."""
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
        if changes is not None:
            changes.append(len(tr.turns))
        if tool_style in ("short", "numbered"):
            act("replace_lines", path=path, start=k, end=k, text=wrong)  # a plausible change ...
            act("replace_lines", path=path, start=k, end=k, text=line)  # ... copied back exactly
        elif tool_style == "lines":  # whole lines: unique, as the stripped line is (`_copyable_lines`)
            act("str_replace", path=path, old=line, new=wrong)
            act("str_replace", path=path, old=wrong, new=line)
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


def copy_sequences(n: int, ids: Sequence[int], *, length: int = 96, seed: int = 0) -> list[Episode]:
    """`n` synthetic copy sequences over `ids`: a random prefix of random length m
    (8 <= m <= length / 2), then that prefix repeated to `length`; loss on the repeat from its
    second token on (the first cannot be known to start a repeat).

    The circuit every edit needs is a content-keyed copy (an induction head: find where the
    current token occurred before and emit what followed it). In the drills it is supervised
    on a few tokens per call and never forms in their budget; here half of every sequence is
    such a copy, its distance differs from row to row (no single relative position finds it),
    and `copy_probe.py --task=repeat` measures how fast it forms. Deterministic in `seed`.
    """
    if length < 16 or len(ids) < 2:
        raise ValueError(f"copy_sequences needs length >= 16 (got {length}) and at least 2 ids (got {len(ids)})")
    pool = np.asarray(ids, np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        m = int(rng.integers(8, length // 2 + 1))
        seq = np.resize(rng.choice(pool, m), length).tolist()  # prefix, then its repeats
        mask = [0] * (m + 1) + [1] * (length - m - 1)
        out.append(Episode(seq, mask, [0.0] * length, [0] * length, group_id=i))
    return out


def whole_transcript_loss(episodes: list[Episode]) -> list[Episode]:
    """`episodes` with `loss_mask` 1 on every token after their longest common prefix (the
    system prompt every episode shares, which would only dilute the mean); 0 before it.

    Raises ValueError for fewer than two episodes (no shared prefix to find) or when an
    episode is nothing but that prefix.
    """
    if len(episodes) < 2:
        raise ValueError("whole_transcript_loss needs at least two episodes to find their shared prompt")
    first = episodes[0].ids
    n = min(len(e.ids) for e in episodes)
    for e in episodes[1:]:
        n = next((k for k in range(n) if e.ids[k] != first[k]), n)
    if n >= min(len(e.ids) for e in episodes):
        raise ValueError("an episode is only the shared prompt: nothing to train on")
    return [replace(e, loss_mask=[0] * n + [1] * (len(e.ids) - n)) for e in episodes]


def mask_change_addresses(episode: Episode, turns: Sequence[int], decode, files: dict[str, str]) -> Episode:
    """`episode` with `loss_mask` 0 on the address (`edits.edit_parts`: "lines" or "old") of
    its assistant turns numbered `turns` (0-based, in order).

    A drill's change edit picks its line at random: no context predicts it, so its loss only
    teaches that the first edits after `read_file` go to random lines, where in every
    demonstration the first edit goes to the bug. The text it then writes is still a copy of
    the line the address names, and stays in the loss."""
    by_turn = policy_turns(episode.loss_mask, episode.turn_id)
    mask = list(episode.loss_mask)
    for k in turns:
        pos = by_turn[k]
        kinds = edit_parts([episode.ids[p] for p in pos], decode, files)
        if kinds is None:
            raise ValueError(f"turn {k} of the drill is not an edit call: nothing to mask")
        for p, kind in zip(pos, kinds):
            if kind in ("lines", "old"):
                mask[p] = 0
    return replace(episode, loss_mask=mask)


def make_drills(tasks: list[Task], chat: ChatFormat, *, seed: int, extra_edits: int = 2,
                system_prompt: str | None = None, mask_changes: bool = False) -> list[Episode]:
    """One drill episode per task (in order), in `chat`'s tool style; deterministic in
    (seed, task index). With `mask_changes`, the change edits' addresses are out of the
    loss (`mask_change_addresses`)."""
    kw = {} if system_prompt is None else {"system_prompt": system_prompt}
    out = []
    with tempfile.TemporaryDirectory(prefix="jxa-drills-") as root:
        for i, task in enumerate(tasks):
            ws = create_workspaces(workspace_files(task), os.path.join(root, str(i)), 1)[0]
            changes: list[int] = []
            tr = drill_transcript(task, ws, random.Random(f"{seed}|{i}"), extra_edits, chat.tool_style, changes)
            ep = transcript_to_episode(tr, task, chat, group_id=i, **kw)
            if mask_changes:
                ep = mask_change_addresses(ep, changes, chat.tokenizer.decode, workspace_files(task))
            out.append(ep)
    return out
