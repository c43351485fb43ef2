"""The scripted expert: real tool calls, valid episodes, imperfections that behave as named."""
import random

import pytest

from jaxrl_agent.env.expert import STYLES, _edits, _wrong, measure, run_expert
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import ToolCall, ToolConfig, create_workspaces, format_tool_call, parse_tool_call

TASK = binary_search_task()


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=2, timeout_s=10) as s:
        yield s


def episode(sb, tmp_path, style, task=TASK, seed=0):
    ws = create_workspaces({**task.files, **task.dev_tests}, str(tmp_path / style), 1)[0]
    return run_expert(task, ws, sb, style, random.Random(seed))


def tools_used(tr):
    return [parse_tool_call(a).name for a, _ in tr.turns]


def test_transcript_is_a_valid_episode(sb, tmp_path):
    tr = episode(sb, tmp_path, "perfect")
    assert tr.reward == 1.0 and tr.termination == "submitted"
    for assistant, observation in tr.turns:
        c = parse_tool_call(assistant)
        assert isinstance(c, ToolCall) and assistant == format_tool_call(c.name, c.arguments)
        assert isinstance(observation, str) and observation
    names = tools_used(tr)
    assert names[-1] == "submit" and names.count("str_replace") == 2
    assert names.index("run_tests") < names.index("str_replace")
    assert tr.turns[-2][1] == "3 passed."  # re-ran the tests after the fix
    assert tr.to_dict()["turns"][0][0] == tr.turns[0][0]


def test_skip_tests_never_runs_them(sb, tmp_path):
    tr = episode(sb, tmp_path, "skip_tests")
    assert "run_tests" not in tools_used(tr) and tr.reward == 1.0


def test_first_bug_only_fails_a_two_bug_task(sb, tmp_path):
    tr = episode(sb, tmp_path, "first_bug_only")
    assert tools_used(tr).count("str_replace") == 1
    assert tr.reward == 0.0 and tr.verify_info["reason"] == "failed"


def test_wrong_first_edit_recovers_after_failing_run(sb, tmp_path):
    tr = episode(sb, tmp_path, "wrong_first_edit")
    names = tools_used(tr)
    first_edit = names.index("str_replace")
    assert names[first_edit + 1] == "run_tests"
    assert "failed" in tr.turns[first_edit + 1][1]
    assert names.count("str_replace") == 3 and tr.reward == 1.0


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


def test_success_rates_order_on_generated_tasks(sb):
    tasks = generate_tasks("train", 4, 2)
    res = measure(tasks, sb, styles=STYLES, cfg=ToolConfig(test_timeout_s=0.3))
    assert res["perfect"]["success_rate"] == 1.0
    assert res["skip_tests"]["success_rate"] == 1.0
    multi = sum(t.metadata["n_bugs"] > 1 for t in tasks) / len(tasks)
    assert res["first_bug_only"]["success_rate"] <= 1.0 - multi + 1e-9
    for r in res.values():
        assert r["n"] == 4 and set(r["terminations"]) == {"submitted"}


def test_episodes_are_repeatable(sb, tmp_path):
    """Same task, style and seed: the same assistant texts and the same tool results."""
    a = episode(sb, tmp_path / "a", "wrong_first_edit", seed=3)
    b = episode(sb, tmp_path / "b", "wrong_first_edit", seed=3)
    assert a.turns == b.turns and a.reward == b.reward
