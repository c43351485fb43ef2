"""The tool-call API (HOST, no heavy imports): tool schemas, the call text format, the parser.

Two tool sets, one per chat tool style (`tool_schemas(style)`): "full" (for pretrained chat
models) edits with `str_replace(path, old, new)`; "short" (for the tiny policies trained
here) edits with the line-addressed `replace_lines(path, start, end, text)`, whose `text` is
whole lines, indentation included, exactly as `read_file` prints them after `N|`. An edit is
then a copy at the token level: the argument's tokens are the observation's tokens (tested
in tests/test_tokenizer.py), where `str_replace`'s stripped `old` is tokenized differently
from the same text inside an indented line.

Text format (Qwen2.5 / Hermes): the assistant writes
    <tool_call>
    {"name": "read_file", "arguments": {"path": "bsearch.py"}}
    </tool_call>
One call per assistant message. `parse_tool_call` never raises: every bad input (malformed
JSON, unknown tool, missing / extra / mistyped / oversized arguments) becomes a `ParseError`
whose message the model sees. `tokenizer.py` renders calls with the same `format_tool_call`,
and `tools.py` runs the parsed calls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# ---- schemas ----

ALL_TOOL_SCHEMAS: list[dict] = [
    {"type": "function", "function": {
        "name": "list_files", "description": "List the files in the repository.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Show a file with line numbers (optionally only lines start..end).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File path, relative to the repository."},
            "start_line": {"type": "integer", "description": "First line to show (1-based)."},
            "end_line": {"type": "integer", "description": "Last line to show (inclusive)."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "str_replace",
        "description": "Replace the text `old` (which must occur exactly once) with `new`.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File path, relative to the repository."},
            "old": {"type": "string", "description": "Exact text to replace (unique)."},
            "new": {"type": "string", "description": "Replacement text."}},
            "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "replace_lines",
        "description": "Replace lines start..end (inclusive, 1-based) with `text` (whole lines, "
                       "indentation included, as read_file shows them after `N|`).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File path, relative to the repository."},
            "start": {"type": "integer", "description": "First line to replace (1-based)."},
            "end": {"type": "integer", "description": "Last line to replace (inclusive; "
                                                      "start - 1 inserts before start)."},
            "text": {"type": "string", "description": "The new lines (\\n-separated; empty "
                                                      "deletes the range)."}},
            "required": ["path", "start", "end", "text"]}}},
    {"type": "function", "function": {
        "name": "run_tests",
        "description": "Run the repository's tests; shows a summary and the first failure.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Submit the current code and end the episode.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]

_BY_NAME = {s["function"]["name"]: s for s in ALL_TOOL_SCHEMAS}
TOOL_SETS: dict[str, tuple[str, ...]] = {
    "full": ("list_files", "read_file", "str_replace", "run_tests", "submit"),
    "short": ("list_files", "read_file", "replace_lines", "run_tests", "submit"),
    "numbered": ("list_files", "read_file", "replace_lines", "run_tests", "submit"),
    "lines": ("list_files", "read_file", "str_replace", "run_tests", "submit"),
}
"""The tools offered in each chat tool style (`tokenizer.ChatFormat.tool_style`). "numbered" is
"short" whose demonstrations write `replace_lines` text with read_file's `N|` prefixes
(`10|    x = 1`): the line is then copied after the same tokens that precede it in the
observation, a plain induction copy instead of a look-up by line number. "lines" edits with
`str_replace` whose `old` and `new` are whole lines, indentation included, as read_file prints
them after `N|`: the edit is addressed by the line's content, so it needs no line number (a
look-up from a line back to the digits before it), and both arguments are token-for-token
copies of the observation (a line's tokens are the same inside the call's JSON string)."""
EDIT_TOOLS = ("str_replace", "replace_lines")
"""Tools that change the workspace (behaviour statistics and shaping count these as edits)."""


def tool_schemas(style: str = "full") -> list[dict]:
    """The OpenAI function-format schemas of the tools offered in `style` (a `TOOL_SETS` key)."""
    if style not in TOOL_SETS:
        raise ValueError(f"unknown tool style {style!r}; expected one of {sorted(TOOL_SETS)}")
    return [_BY_NAME[n] for n in TOOL_SETS[style]]


TOOL_SCHEMAS: list[dict] = tool_schemas("full")
"""The full style's tools (str_replace edits), as Qwen2.5-style chat models expect them."""

# One line per tool, for the short system prompt of tiny models (DESIGN §7).
TOOL_DESCRIPTIONS = "\n".join([
    "list_files() - list the files",
    "read_file(path, start_line?, end_line?) - show numbered lines",
    "str_replace(path, old, new) - replace the unique text old with new",
    "replace_lines(path, start, end, text) - replace lines start..end with text",
    "run_tests() - run the tests",
    "submit() - finish",
])

_SPECS = {name: s["function"]["parameters"] for name, s in _BY_NAME.items()}
_PY_TYPES = {"string": str, "integer": int}


# ---- parsing ----


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParseError:
    """An interface error; `message` is what the model sees."""

    kind: str
    """no_call | multiple_calls | malformed_json | bad_structure | unknown_tool |
    bad_arguments | oversized"""
    message: str


OPEN, CLOSE = "<tool_call>", "</tool_call>"


def format_tool_call(name: str, arguments: dict | None = None) -> str:
    """The exact text of one call, as Qwen2.5's chat template renders it."""
    body = json.dumps({"name": name, "arguments": arguments or {}}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def parse_tool_call(text, max_arg_chars: int = 4000,
                    allowed: tuple[str, ...] | None = None) -> ToolCall | ParseError:
    """Extract and validate the single tool call in `text`; never raises.

    `allowed` names the tools offered in this episode (None: every known tool); any other
    name is an `unknown_tool` interface error."""
    try:
        return _parse(text, max_arg_chars, tuple(_SPECS) if allowed is None else tuple(allowed))
    except Exception as e:  # noqa: BLE001 - defensive: the parser must never crash a rollout
        return ParseError("malformed_json", f"Error: could not parse the tool call ({type(e).__name__}).")


def _parse(text, max_arg_chars: int, allowed: tuple[str, ...]) -> ToolCall | ParseError:
    if not isinstance(text, str):
        return ParseError("no_call", "Error: expected text containing a tool call.")
    n_open = text.count(OPEN)
    if n_open == 0:
        return ParseError("no_call", f"Error: no tool call found. Write {OPEN}"
                          '{"name": ..., "arguments": {...}}' f"{CLOSE}.")
    if n_open > 1:
        return ParseError("multiple_calls", "Error: write exactly one tool call per message.")
    body = text.split(OPEN, 1)[1]
    if CLOSE in body:
        body = body.split(CLOSE, 1)[0]
    body = body.strip()
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        msg = getattr(e, "msg", "too deeply nested")
        return ParseError("malformed_json", f"Error: the tool call is not valid JSON ({msg}).")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError("bad_structure", 'Error: a tool call is {"name": <tool name>, '
                          '"arguments": {...}}.')
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return ParseError("bad_structure", f"Error: unexpected key(s) {sorted(extra)} in the "
                          'tool call; use only "name" and "arguments".')
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ParseError("malformed_json", "Error: the arguments are not valid JSON.")
    if not isinstance(args, dict):
        return ParseError("bad_structure", "Error: arguments must be a JSON object.")
    if name not in _SPECS or name not in allowed:
        return ParseError("unknown_tool", f"Error: unknown tool {name[:60]!r}. Tools: "
                          + ", ".join(n for n in _SPECS if n in allowed) + ".")
    spec = _SPECS[name]
    props, required = spec["properties"], spec["required"]
    missing = [a for a in required if a not in args]
    if missing:
        return ParseError("bad_arguments", f"Error: {name} is missing argument(s): "
                          + ", ".join(missing) + ".")
    unknown = sorted(set(args) - set(props))
    if unknown:
        allowed = ", ".join(props) or "none"
        return ParseError("bad_arguments", f"Error: {name} got unexpected argument(s): "
                          f"{', '.join(a[:40] for a in unknown)} (allowed: {allowed}).")
    for a, v in args.items():
        want = _PY_TYPES[props[a]["type"]]
        if not isinstance(v, want) or isinstance(v, bool):
            return ParseError("bad_arguments", f"Error: argument {a} of {name} must be "
                              f"{'a string' if want is str else 'an integer'}.")
        if want is str and len(v) > max_arg_chars:
            return ParseError("oversized", f"Error: argument {a} is too long ({len(v)} > "
                              f"{max_arg_chars} characters).")
    return ToolCall(name, dict(args))
