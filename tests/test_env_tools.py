"""Tool-call parser (every error path, fuzzing), tools over a workspace, episode limits."""
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task
from jaxrl_agent.env.tools import (TOOL_DESCRIPTIONS, TOOL_SCHEMAS, TOOL_SETS, ParseError, ToolCall,
                                   ToolConfig, Tools, ToolSession, create_workspaces,
                                   format_tool_call, parse_tool_call, tool_schemas)

TASK = binary_search_task()


@pytest.fixture
def ws(tmp_path):
    return create_workspaces({**TASK.files, **TASK.dev_tests}, str(tmp_path), 1)[0]


def call(tools, name, **args):
    return tools(ToolCall(name, args))


# ---- schemas and format ----


def test_schemas_and_descriptions_cover_every_tool():
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert names == ["list_files", "read_file", "str_replace", "run_tests", "submit"] == list(TOOL_SETS["full"])
    short = [s["function"]["name"] for s in tool_schemas("short")]
    assert short == ["list_files", "read_file", "replace_lines", "run_tests", "submit"]
    for s in tool_schemas("full") + tool_schemas("short"):
        assert s["type"] == "function" and s["function"]["parameters"]["type"] == "object"
    described = [ln.split("(")[0] for ln in TOOL_DESCRIPTIONS.splitlines()]
    assert set(described) == set(names) | set(short)
    with pytest.raises(ValueError, match="tool style"):
        tool_schemas("medium")


def test_a_tool_outside_the_episodes_set_is_an_unknown_tool():
    text = format_tool_call("str_replace", {"path": "a.py", "old": "x", "new": "y"})
    err = parse_tool_call(text, allowed=TOOL_SETS["short"])
    assert isinstance(err, ParseError) and err.kind == "unknown_tool"
    assert "replace_lines" in err.message and "str_replace" not in err.message.split("Tools:")[1]
    assert isinstance(parse_tool_call(text, allowed=TOOL_SETS["full"]), ToolCall)


def test_format_is_hermes_and_roundtrips():
    text = format_tool_call("str_replace", {"path": "a.py", "old": "x < 1", "new": "x <= 1"})
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    assert json.loads(text[len("<tool_call>"):-len("</tool_call>")]) == {
        "name": "str_replace", "arguments": {"path": "a.py", "old": "x < 1", "new": "x <= 1"}}
    assert parse_tool_call(text) == ToolCall("str_replace",
                                             {"path": "a.py", "old": "x < 1", "new": "x <= 1"})
    assert parse_tool_call("Let me look.\n" + format_tool_call("list_files")) == \
        ToolCall("list_files", {})


# ---- parser error paths ----


@pytest.mark.parametrize("text,kind", [
    ("I will read the file now.", "no_call"),
    (None, "no_call"),
    (format_tool_call("list_files") + format_tool_call("submit"), "multiple_calls"),
    ("<tool_call>{name: list_files}</tool_call>", "malformed_json"),
    ('<tool_call>{"name": "list_files", "arguments": {}</tool_call>', "malformed_json"),
    ('<tool_call>["list_files"]</tool_call>', "bad_structure"),
    ('<tool_call>{"arguments": {}}</tool_call>', "bad_structure"),
    ('<tool_call>{"name": "submit", "arguments": {}, "id": 1}</tool_call>', "bad_structure"),
    ('<tool_call>{"name": "submit", "arguments": [1]}</tool_call>', "bad_structure"),
    ('<tool_call>{"name": "submit", "arguments": "{oops"}</tool_call>', "malformed_json"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown_tool"),
    ('<tool_call>{"name": "read_file", "arguments": {}}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "submit", "arguments": {"now": true}}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "read_file", "arguments": {"path": 3}}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "read_file", "arguments": {"path": "a", "start_line": "1"}}'
     '</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "read_file", "arguments": {"path": "a", "start_line": true}}'
     '</tool_call>', "bad_arguments"),
    (format_tool_call("str_replace", {"path": "a", "old": "x" * 5000, "new": ""}), "oversized"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "malformed_json"),
])
def test_parse_errors(text, kind):
    res = parse_tool_call(text)
    assert isinstance(res, ParseError) and res.kind == kind, res
    assert res.message.startswith("Error:")


def test_lenient_forms():
    # Missing closing tag (the stop token may be cut), arguments omitted or as a string.
    assert parse_tool_call('<tool_call>\n{"name": "submit"}') == ToolCall("submit", {})
    assert parse_tool_call('<tool_call>{"name": "read_file", "arguments": "{\\"path\\": '
                           '\\"a.py\\"}"}</tool_call>') == ToolCall("read_file", {"path": "a.py"})


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=300),
    st.text(max_size=200).map(lambda s: "<tool_call>" + s + "</tool_call>"),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                     max_size=4),
                 max_leaves=12).map(lambda o: "<tool_call>" + json.dumps(o) + "</tool_call>"),
    st.fixed_dictionaries({"name": st.sampled_from(["read_file", "str_replace", "submit", "x"]),
                           "arguments": st.dictionaries(
                               st.sampled_from(["path", "old", "new", "start_line", "z"]),
                               st.one_of(st.integers(), st.text(max_size=10), st.none()))}
                          ).map(lambda o: format_tool_call(o["name"], o["arguments"]))))
def test_parser_never_raises(text):
    res = parse_tool_call(text)
    assert isinstance(res, (ToolCall, ParseError))
    if isinstance(res, ToolCall):
        assert format_tool_call(res.name, res.arguments).count("<tool_call>") == 1


# ---- tools ----


def test_list_and_read(ws):
    tools = Tools(ws, ["test_bsearch.py"])
    assert call(tools, "list_files").text == "bsearch.py\ntest_bsearch.py"
    text = call(tools, "read_file", path="bsearch.py").text
    assert text.splitlines()[0] == "1|def binary_search(arr, target):"
    assert call(tools, "read_file", path="bsearch.py", start_line=10, end_line=10).text == \
        "10|            low = mid"
    assert call(tools, "read_file", path="bsearch.py", start_line=12, end_line=99).text.count(
        "\n") == 1


@pytest.mark.parametrize("args,msg", [
    (dict(path="nope.py"), "no file"),
    (dict(path="../bsearch.py"), "outside"),
    (dict(path="/etc/passwd"), "outside"),
    (dict(path="a\\b.py"), "invalid path"),
    (dict(path=""), "invalid path"),
    (dict(path="bsearch.py", start_line=0), "bad line range"),
    (dict(path="bsearch.py", start_line=50), "bad line range"),
    (dict(path="bsearch.py", start_line=5, end_line=2), "bad line range"),
])
def test_read_errors(ws, args, msg):
    res = call(Tools(ws, []), "read_file", **args)
    assert not res.ok and msg in res.text and not res.done


def test_binary_file_is_an_error_not_a_crash(ws):
    with open(os.path.join(ws, "blob.bin"), "wb") as f:
        f.write(bytes(range(256)))
    res = call(Tools(ws, []), "read_file", path="blob.bin")
    assert not res.ok and res.text.startswith("Error: UnicodeDecodeError")


def test_symlink_out_of_workspace_is_refused(ws, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    os.symlink(secret, os.path.join(ws, "link.py"))
    res = call(Tools(ws, []), "read_file", path="link.py")
    assert not res.ok and "outside" in res.text
    assert "link.py" not in call(Tools(ws, []), "list_files").text


def test_str_replace(ws):
    tools = Tools(ws, [])
    res = call(tools, "str_replace", path="bsearch.py", old="low = mid\n", new="low = mid + 1\n")
    assert res.ok and res.text == "Edited bsearch.py at line 10."
    assert "low = mid + 1" in open(os.path.join(ws, "bsearch.py")).read()
    for args, msg in [(dict(old="nothing like this", new=""), "not found"),
                      (dict(old="mid", new="m"), "occurs"),
                      (dict(old="", new="x"), "must not be empty")]:
        res = call(tools, "str_replace", path="bsearch.py", **args)
        assert not res.ok and msg in res.text
    res = call(tools, "str_replace", path="../x.py", old="a", new="b")
    assert not res.ok and "outside" in res.text


def test_replace_lines(ws):
    tools = Tools(ws, [])
    before = open(os.path.join(ws, "bsearch.py")).read().splitlines()
    res = call(tools, "replace_lines", path="bsearch.py", start=10, end=10, text="            low = mid + 1")
    assert res.ok and res.text == "Edited bsearch.py:\n10|            low = mid + 1"
    after = open(os.path.join(ws, "bsearch.py")).read()
    assert after.endswith("\n") and after.splitlines() == before[:9] + ["            low = mid + 1"] + before[10:]
    # several lines, a trailing newline in text is not an extra line
    call(tools, "replace_lines", path="bsearch.py", start=1, end=2, text="A\nB\nC\n")
    assert open(os.path.join(ws, "bsearch.py")).read().splitlines()[:4] == ["A", "B", "C", before[2]]
    # end = start - 1 inserts, empty text deletes
    call(tools, "replace_lines", path="bsearch.py", start=1, end=0, text="# top")
    assert open(os.path.join(ws, "bsearch.py")).read().splitlines()[:2] == ["# top", "A"]
    res = call(tools, "replace_lines", path="bsearch.py", start=1, end=4, text="")
    assert res.text == "Edited bsearch.py: deleted lines 1-4."
    assert open(os.path.join(ws, "bsearch.py")).read().splitlines() == before[2:9] + [
        "            low = mid + 1"] + before[10:]


def test_replace_lines_accepts_read_files_numbers(ws):
    """Text written as read_file shows it (`10|line`) edits like the bare line; numbers that do
    not run start..end are an error that changes nothing."""
    from jaxrl_agent.env.tools import number_text

    tools = Tools(ws, [])
    text = number_text("            low = mid + 1", 10)
    assert text == "10|            low = mid + 1"
    res = call(tools, "replace_lines", path="bsearch.py", start=10, end=10, text=text)
    assert res.ok and res.text == "Edited bsearch.py:\n10|            low = mid + 1"
    before = open(os.path.join(ws, "bsearch.py")).read()
    for bad in ("11|            low = mid", "10|a\nb", "10|a\n12|b"):
        res = call(tools, "replace_lines", path="bsearch.py", start=10, end=11, text=bad)
        assert not res.ok and "numbered text" in res.text
    assert open(os.path.join(ws, "bsearch.py")).read() == before
    call(tools, "replace_lines", path="bsearch.py", start=10, end=11, text=number_text("a\nb", 10))
    assert open(os.path.join(ws, "bsearch.py")).read().splitlines()[9:11] == ["a", "b"]


@pytest.mark.parametrize("report", [False, True])
def test_an_edit_that_changes_nothing_is_marked(ws, report):
    """Rewriting lines with what they already hold (or str_replace with old == new) leaves the
    file as it was, not even rewritten, and `changed` is False so the reward can see it; with
    `report_unchanged` the observation says so instead of the usual "Edited"."""
    tools = Tools(ws, [], cfg=ToolConfig(report_unchanged=report))
    path = os.path.join(ws, "bsearch.py")
    before, inode = open(path).read(), os.stat(path).st_ino
    line10 = before.splitlines()[9]
    for args in ({"start": 10, "end": 10, "text": line10}, {"start": 10, "end": 10, "text": line10 + "\n"},
                 {"start": 10, "end": 10, "text": f"10|{line10}"}, {"start": 3, "end": 2, "text": ""}):
        res = call(tools, "replace_lines", path="bsearch.py", **args)
        assert res.ok and res.changed is False, args
        assert res.text.startswith("No change: bsearch.py" if report else "Edited bsearch.py"), (args, res.text)
    assert call(tools, "replace_lines", path="bsearch.py", start=10, end=10, text=line10).text == (
        f"No change: bsearch.py lines 10-10 already read this; the file is as it was." if report
        else f"Edited bsearch.py:\n10|{line10}")  # what it always said
    res = call(tools, "str_replace", path="bsearch.py", old="low = mid\n", new="low = mid\n")
    assert res.ok and res.changed is False and res.text.startswith("No change" if report else "Edited bsearch.py at")
    assert open(path).read() == before and os.stat(path).st_ino == inode  # not even rewritten
    res = call(tools, "replace_lines", path="bsearch.py", start=10, end=10, text="            low = mid + 1")
    assert res.ok and res.changed is True and res.text.startswith("Edited")
    assert call(tools, "read_file", path="bsearch.py").changed is None  # not an edit


@pytest.mark.parametrize("start,end", [(0, 1), (3, 1), (1, 99), (99, 99)])
def test_replace_lines_bad_range_is_an_error(ws, start, end):
    before = open(os.path.join(ws, "bsearch.py")).read()
    res = call(Tools(ws, []), "replace_lines", path="bsearch.py", start=start, end=end, text="x")
    assert not res.ok and "bad line range" in res.text and not res.done
    assert open(os.path.join(ws, "bsearch.py")).read() == before


def test_replace_lines_arguments_are_checked_by_the_parser():
    text = format_tool_call("replace_lines", {"path": "a.py", "start": "3", "end": 3, "text": "x"})
    err = parse_tool_call(text)
    assert isinstance(err, ParseError) and err.kind == "bad_arguments" and "start" in err.message
    err = parse_tool_call(format_tool_call("replace_lines", {"path": "a.py", "start": 3, "text": "x"}))
    assert isinstance(err, ParseError) and "missing" in err.message and "end" in err.message


def test_workspaces_are_independent_hard_link_farm(tmp_path):
    a, b = create_workspaces(TASK.files, str(tmp_path), 2)
    assert os.stat(os.path.join(a, "bsearch.py")).st_ino == os.stat(
        os.path.join(b, "bsearch.py")).st_ino
    call(Tools(a, []), "str_replace", path="bsearch.py", old="low = mid\n", new="low = mid + 1\n")
    assert open(os.path.join(b, "bsearch.py")).read() == TASK.files["bsearch.py"]


def test_long_output_is_truncated(ws):
    with open(os.path.join(ws, "big.py"), "w") as f:
        f.write("x = 1\n" * 2000)
    res = call(Tools(ws, [], cfg=ToolConfig(max_output_chars=300)), "read_file", path="big.py")
    assert len(res.text) < 340 and res.text.endswith("(output truncated)")


def test_run_tests_without_sandbox_is_an_error(ws):
    res = call(Tools(ws, ["test_bsearch.py"]), "run_tests")
    assert not res.ok and "not available" in res.text and not res.done


def test_run_tests_summary_and_first_failure(ws):
    with Sandbox(num_workers=1, timeout_s=10) as sb:
        tools = Tools(ws, ["test_bsearch.py"], sb)
        assert call(tools, "run_tests").text == (
            "2 passed, 1 failed.\n"
            "FAILED test_last_1: TimeoutError: test timed out after 0.5s (infinite loop?)")
        call(tools, "str_replace", path="bsearch.py", old="low = mid\n", new="low = mid + 1\n")
        assert call(tools, "run_tests").text == "3 passed."
        call(tools, "str_replace", path="bsearch.py", old="    low = 0\n", new="    low = (\n")
        text = call(tools, "run_tests").text
        assert text.startswith("1 error.\nERROR collecting test_bsearch.py:")


# ---- episode limits ----


def test_session_terminations(ws):
    cfg = ToolConfig(max_parse_errors=2, max_turns=4)
    s = ToolSession(Tools(ws, []), cfg)
    r = s.step("no call here")
    assert not r.done and r.error.kind == "no_call"
    r = s.step(format_tool_call("list_files"))
    assert not r.done and r.tool_ok and s.parse_errors_in_row == 0
    s.step("<tool_call>{bad")
    r = s.step('<tool_call>{"name": "nope"}</tool_call>')
    assert r.done and r.termination == "parse_error_limit"
    with pytest.raises(RuntimeError, match="already ended"):
        s.step(format_tool_call("submit"))

    s = ToolSession(Tools(ws, []), cfg)
    r = s.step(format_tool_call("submit"))
    assert r.done and r.termination == "submitted" and r.observation == "Submitted."

    s = ToolSession(Tools(ws, []), cfg)
    for _ in range(3):
        assert not s.step(format_tool_call("read_file", {"path": "missing.py"})).done
    r = s.step(format_tool_call("list_files"))
    assert r.done and r.termination == "max_turns" and len(s.history) == 4
