"""The scripted expert: real tool calls, valid episodes, imperfections that behave as named."""

import pytest

from jaxrl_agent.agent.evaluation import bugs_fixed
from jaxrl_agent.env.expert import STYLES, _edits, _line_edits, _wrong, measure, run_expert
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import ToolCall, ToolConfig, create_workspaces, format_tool_call, parse_tool_call

TASK = binary_search_task()


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=2, timeout_s=10) as s:
        yield s


def episode(sb, tmp_path, style, task=TASK, tool_style="full"):
    ws = create_workspaces({**task.files, **task.dev_tests}, str(tmp_path / f"{style}-{tool_style}"), 1)[0]
    return run_expert(task, ws, sb, style, tool_style=tool_style)


EDIT = {"full": "str_replace", "short": "replace_lines", "numbered": "replace_lines", "lines": "str_replace"}


def tools_used(tr):
    return [parse_tool_call(a).name for a, _ in tr.turns]


@pytest.mark.parametrize("tool_style", ["full", "short", "numbered", "lines"])
def test_transcript_is_a_valid_episode(sb, tmp_path, tool_style):
    tr = episode(sb, tmp_path, "perfect", tool_style=tool_style)
    assert tr.reward == 1.0 and tr.termination == "submitted"
    for assistant, observation in tr.turns:
        c = parse_tool_call(assistant)
        assert isinstance(c, ToolCall) and assistant == format_tool_call(c.name, c.arguments)
        assert isinstance(observation, str) and observation and not observation.startswith("Error")
    names = tools_used(tr)
    assert names[:2] == ["list_files", "read_file"]  # always lists first: the path read is the listing's
    assert names[-1] == "submit" and names.count(EDIT[tool_style]) == 2
    assert names.index("run_tests") < names.index(EDIT[tool_style])
    assert tr.turns[-2][1] == "3 passed."  # re-ran the tests after the fix
    edits = [parse_tool_call(a).arguments for a, _ in tr.turns if EDIT[tool_style] in a]
    if tool_style == "numbered":
        assert all(e["text"].startswith(f"{e['start']}|") for e in edits)
    elif tool_style == "short":
        assert all(e["text"].startswith(" ") for e in edits)  # whole lines, indentation included
    elif tool_style == "lines":  # whole lines as read_file prints them, each a line of the file
        lines = TASK.files[TASK.metadata["source_file"]].splitlines()
        assert [e["old"] for e in edits] == ["            low = mid", "            high = mid"]
        assert all(e["old"] in lines and e["new"].startswith(e["old"]) for e in edits)
    assert tr.to_dict()["turns"][0][0] == tr.turns[0][0]


def test_skip_tests_never_runs_them(sb, tmp_path):
    tr = episode(sb, tmp_path, "skip_tests")
    assert "run_tests" not in tools_used(tr) and tr.reward == 1.0


@pytest.mark.parametrize("tool_style", ["full", "short"])
def test_first_bug_only_fails_a_two_bug_task(sb, tmp_path, tool_style):
    tr = episode(sb, tmp_path, "first_bug_only", tool_style=tool_style)
    assert tools_used(tr).count(EDIT[tool_style]) == 1
    assert tr.reward == 0.0 and tr.verify_info["reason"] == "failed"


@pytest.mark.parametrize("tool_style", ["full", "short", "lines"])
def test_wrong_first_edit_recovers_after_failing_run(sb, tmp_path, tool_style):
    tr = episode(sb, tmp_path, "wrong_first_edit", tool_style=tool_style)
    names = tools_used(tr)
    first_edit = names.index(EDIT[tool_style])
    assert names[first_edit + 1] == "run_tests"
    assert "failed" in tr.turns[first_edit + 1][1]
    assert names.count(EDIT[tool_style]) == 3 and tr.reward == 1.0


@pytest.mark.parametrize("tool_style", ["full", "short"])
def test_stop_after_failure_submits_despite_the_failing_run(sb, tmp_path, tool_style):
    tr = episode(sb, tmp_path, "stop_after_failure", tool_style=tool_style)
    names = tools_used(tr)
    assert names[-3:] == [EDIT[tool_style], "run_tests", "submit"] and names.count(EDIT[tool_style]) == 1
    assert "failed" in tr.turns[-2][1] and tr.reward == 0.0


def test_rerun_tests_runs_them_twice_without_an_edit(sb, tmp_path):
    tr = episode(sb, tmp_path, "rerun_tests", tool_style="short")
    names = tools_used(tr)
    assert names[-3:] == ["run_tests", "run_tests", "submit"] and EDIT["short"] not in names
    assert tr.turns[-3][1] == tr.turns[-2][1] and tr.reward == 0.0


def test_unknown_style(sb, tmp_path):
    with pytest.raises(ValueError, match="unknown expert style"):
        episode(sb, tmp_path, "lazy")


def test_edit_planning_handles_same_line_and_repeated_text():
    cur = "a = 1\nb = x < y and x < z\na = 1\n"
    ref = "a = 1\nb = x <= y and x <= z\na = 1\n"
    edits = _edits(cur, ref)
    assert len(edits) == 1 and cur.count(edits[0][0]) == 1
    assert cur.replace(*edits[0]) == ref
    cur, ref = "x = 0\nx = 0\nx = 0\n", "x = 0\nx = 1\nx = 0\n"
    for _ in range(5):  # the expert's loop: apply the first edit, re-plan
        plan = _edits(cur, ref)
        if not plan:
            break
        assert cur.count(plan[0][0]) == 1
        cur = cur.replace(*plan[0])
    assert cur == ref
    assert _wrong("low = mid + 1\n", "low = mid\n") == "low = mid + 2\n"


def test_whole_line_str_replace_edits_are_unique_whole_lines():
    """"lines" style: `old` keeps the indentation and is grown to a unique block when the line
    alone is not unique (also as a substring of a more indented line)."""
    cur = "def f(a):\n    x = a < 1\n    y = a < 2\n    return x\n"
    ref = "def f(a):\n    x = a <= 1\n    y = a <= 2\n    return x\n"
    assert _edits(cur, ref, whole_lines=True) == [("    x = a < 1\n    y = a < 2", "    x = a <= 1\n    y = a <= 2")]
    cur, ref = "if a:\n        x = 0\n    x = 0\n", "if a:\n        x = 0\n    x = 1\n"
    (old, new), = _edits(cur, ref, whole_lines=True)
    assert cur.count(old) == 1 and cur.replace(old, new) == ref and old.endswith("    x = 0")
    assert _edits("a\nb", "a\nc", whole_lines=True) == [("b", "c")]  # no final newline


def test_line_edits_are_whole_lines_in_file_order():
    cur = "def f(a):\n    x = a < 1\n    y = a < 2\n    return x\n"
    ref = "def f(a):\n    x = a <= 1\n    y = a <= 2\n    return x\n"
    assert _line_edits(cur, ref) == [(2, 2, "    x = a <= 1"), (3, 3, "    y = a <= 2")]
    assert _line_edits(cur, cur) == []
    # a block that changes its line count is one call; an insertion has end = start - 1
    assert _line_edits("a\nc\n", "a\nb\nc\n") == [(2, 1, "b")]
    assert _line_edits("a\nb\nb\nc\n", "a\nx\nc\n") == [(2, 3, "x")]


@pytest.mark.parametrize("tool_style", ["full", "short", "lines"])
def test_success_rates_order_on_generated_tasks(sb, tool_style):
    tasks = generate_tasks("train", 4, 2)
    res = measure(tasks, sb, styles=STYLES, cfg=ToolConfig(test_timeout_s=0.3), tool_style=tool_style)
    assert res["perfect"]["success_rate"] == 1.0
    assert res["skip_tests"]["success_rate"] == 1.0
    multi = sum(t.metadata["n_bugs"] > 1 for t in tasks) / len(tasks)
    assert res["first_bug_only"]["success_rate"] <= 1.0 - multi + 1e-9
    assert res["rerun_tests"]["success_rate"] == 0.0
    for r in res.values():
        assert r["n"] == 4 and set(r["terminations"]) == {"submitted"}


def test_episodes_are_repeatable(sb, tmp_path):
    """Same task and style: the same assistant texts and the same tool results."""
    a = episode(sb, tmp_path / "a", "wrong_first_edit")
    b = episode(sb, tmp_path / "b", "wrong_first_edit")
    assert a.turns == b.turns and a.reward == b.reward


@pytest.mark.parametrize("tool_style", ["full", "short"])
def test_recover_after_failing_run_fixes_one_checks_then_fixes_the_rest(sb, tmp_path, tool_style):
    """The recovery of wrong_first_edit with every edit right: on a two-bug task whose dev
    tests see both bugs, the run after the first fix fails, so it fixes the rest, re-runs and
    submits. On the canonical task the dev tests miss the second bug: the run passes and it
    submits with the hidden bug left (a decision the verifier pays for)."""
    task = generate_tasks("train", 1, 2)[0]
    assert task.metadata["n_bugs"] == 2
    tr = episode(sb, tmp_path, "recover_after_failing_run", task=task, tool_style=tool_style)
    names, edit = tools_used(tr), EDIT[tool_style]
    first = names.index(edit)
    assert names[first + 1] == "run_tests" and "failed" in tr.turns[first + 1][1]
    assert names[first + 2] == edit and names[-2:] == ["run_tests", "submit"]
    assert "passed" in tr.turns[-2][1] and "failed" not in tr.turns[-2][1] and tr.reward == 1.0
    canonical = episode(sb, tmp_path / "canonical", "recover_after_failing_run", tool_style=tool_style)
    assert tools_used(canonical)[-3:] == [edit, "run_tests", "submit"] and canonical.reward == 0.0


@pytest.mark.parametrize("tool_style", ["full", "short"])
def test_stop_after_failing_run_fixes_one_bug_and_submits_despite_the_run(sb, tmp_path, tool_style):
    """The stop of stop_after_failure with every edit right: progress made (one bug fixed),
    then a decision (submit after the failing run), which the classifier calls sequential."""
    task = generate_tasks("train", 1, 2)[0]  # two bugs, both seen by the dev tests
    tr = episode(sb, tmp_path, "stop_after_failing_run", task=task, tool_style=tool_style)
    names = tools_used(tr)
    assert names[-3:] == [EDIT[tool_style], "run_tests", "submit"] and names.count(EDIT[tool_style]) == 1
    assert "failed" in tr.turns[-2][1] and tr.reward == 0.0
    src = task.metadata["source_file"]
    ws = next((tmp_path / f"stop_after_failing_run-{tool_style}").rglob(src))
    assert bugs_fixed(task, {src: ws.read_text()}) == (1, 2)
