"""What each token of one edit call writes (HOST, leaf: no project imports).

An edit turn is tens of tokens that must all be right; split by part, a wrong edit says whether
the policy could not address the line (`replace_lines`' numbers, `str_replace`'s `old`), could
not copy its text, or did not know the fix. `diagnostics.turn_accuracy` scores the parts under
teacher forcing; `drills.mask_change_addresses` drops from the drills' loss the address of an
edit whose line was drawn at random.
"""
from __future__ import annotations

import difflib
import json
import re

import numpy as np

EDIT_PARTS = ("tool", "lines", "old", "copy", "fix", "other")
"""What a token of an edit call can write (`edit_parts`), in the order the report shows them."""


_KINDS = ("other", "lines", "old", "copy", "fix", "tool")  # by the codes of `edit_parts`' character map


def policy_turns(loss_mask, turn_id) -> list[list[int]]:
    """Token positions of each policy turn (the loss-masked tokens, grouped by `turn_id`), in
    turn order; position 0 is never one (no token predicts it)."""
    turns: dict[int, list[int]] = {}
    for t in range(1, len(loss_mask)):
        if loss_mask[t]:
            turns.setdefault(turn_id[t], []).append(t)
    return [turns[k] for k in sorted(turns)]


def _call_span(text: str, key: str, value: str) -> tuple[int, str]:
    """(offset, JSON-escaped form) of string argument `key` = `value` in the call `text`; -1 if absent."""
    raw = json.dumps(value, ensure_ascii=False)[1:-1]
    at = text.find(f'"{key}": "{raw}"')
    return (at + len(f'"{key}": "') if at >= 0 else -1), raw


def edit_parts(ids: list[int], decode, files: dict[str, str]) -> list[str] | None:
    """What each token of one edit turn writes, so a wrong edit says which part went wrong:
    - "tool": the tool's name (choosing to edit now rather than, say, run the tests: a decision);
    - "lines": `replace_lines`' start / end numbers (its address in the file);
    - "old": `str_replace`'s `old` text (its address: a copy of the line(s) to change);
    - "copy": text of the new lines that the replaced lines already hold (a copy from the file);
    - "fix": text the edit adds or changes;
    - "other": path, JSON, stop token.

    Characters are compared in the call's own JSON-escaped form (difflib over the old and new
    lines); a token touching a changed character is "fix". None when `ids` is not one
    well-formed edit call on a file of `files`."""
    text = decode(ids)
    try:
        call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
        name, args = call["name"], call["arguments"]
        path = args["path"]
        if name == "replace_lines":
            start, end, new = int(args["start"]), int(args["end"]), args["text"]
            old = "\n".join(files[path].split("\n")[start - 1:end])
            key = "text"
        elif name == "str_replace":
            old, new, key = args["old"], args["new"], "new"
        else:
            return None
    except (IndexError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if path not in files or not isinstance(new, str) or not isinstance(old, str):
        return None
    at, raw_new = _call_span(text, key, new)
    if at < 0:
        return None
    kind = np.zeros(len(text), np.int8)  # 0 other, 1 lines, 2 old, 3 copy, 4 fix, 5 tool
    at_name, raw_name = _call_span(text, "name", name)
    if at_name >= 0:
        kind[at_name:at_name + len(raw_name)] = 5
    if name == "str_replace":
        at_old, raw_old = _call_span(text, "old", old)
        if at_old < 0:
            return None
        kind[at_old:at_old + len(raw_old)] = 2
    kind[at:at + len(raw_new)] = 3
    matcher = difflib.SequenceMatcher(None, json.dumps(old, ensure_ascii=False)[1:-1], raw_new, autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            kind[at + j1:at + j2] = 4
    for m in re.finditer(r'"(?:start|end)": (\d+)', text[:at] if name == "replace_lines" else ""):
        kind[m.start(1):m.end(1)] = 1
    out, prev = [], 0
    for i in range(len(ids)):
        cut = max(prev, len(decode(ids[: i + 1])))
        span = kind[prev:cut]
        out.append(_KINDS[int(span.max())] if span.size else "other")
        prev = cut
    return out
