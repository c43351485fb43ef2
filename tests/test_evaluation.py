"""agent/evaluation.py: interval and pass@k statistics, and the failure-layer classification on
real tool sessions."""
import itertools
import math

import pytest

from jaxrl_agent.agent.evaluation import (episode_behaviour, paired_difference, pass_at_k, summarize_episodes,
                                          wilson_interval)
from jaxrl_agent.env.tasks import binary_search_task, workspace_files
from jaxrl_agent.env.tools import ToolConfig, Tools, ToolSession, create_workspaces, format_tool_call
from jaxrl_agent.trajectory import Episode


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(0, 50)
    assert lo == 0.0 and 0.0 < hi < 0.1


@pytest.mark.parametrize("n,c,k", [(5, 2, 1), (5, 2, 3), (6, 0, 2), (6, 6, 4), (8, 3, 8)])
def test_pass_at_k_matches_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_paired_difference_sign_test_and_bootstrap():
    # the sign test against enumeration: 7 of 9 non-tied pairs favour a (one tie left out)
    a = [0.3, 0.2, 0.5, 0.1, 0.4, 0.0, 0.2, 0.3, 0.6, 0.2]
    b = [0.1, 0.1, 0.2, 0.2, 0.1, 0.0, 0.3, 0.1, 0.2, 0.1]
    r = paired_difference(a, b, seed=0)
    brute = sum(math.comb(9, j) for j in range(10) if min(j, 9 - j) <= 2) / 2 ** 9
    assert (r["n"], r["n_pos"], r["n_neg"]) == (10, 7, 2)
    assert r["sign_p"] == pytest.approx(brute, abs=1e-12)
    assert r["mean"] == pytest.approx(sum(x - y for x, y in zip(a, b)) / 10)
    assert r["ci_low"] < r["mean"] < r["ci_high"]
    assert r == paired_difference(a, b, seed=0)  # seeded
    # a constant shift: a degenerate interval at the shift, p = 2 / 2^n
    r = paired_difference([x + 0.25 for x in b], b)
    assert r["ci_low"] == pytest.approx(0.25) and r["ci_high"] == pytest.approx(0.25)
    assert r["sign_p"] == pytest.approx(2 / 2 ** 10)
    # no difference at all: p = 1, and the interval is the point 0
    r = paired_difference(b, b)
    assert r["sign_p"] == 1.0 and r["mean"] == r["ci_low"] == r["ci_high"] == 0.0
    with pytest.raises(ValueError, match="same length"):
        paired_difference([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="at least one pair"):
        paired_difference([], [])


@pytest.fixture
def session(tmp_path):
    task = binary_search_task()
    ws = create_workspaces(workspace_files(task), str(tmp_path), 1)[0]
    # no sandbox: run_tests answers with a tool error, which is what the no-test case needs
    return ToolSession(Tools(ws, sorted(task.dev_tests), None, ToolConfig()), ToolConfig())


def play(session, calls):
    for name, args in calls:
        session.step(name if name.startswith("<") or " " in name else format_tool_call(name, args))
    return session.history


def test_interface_failure(session):
    hist = play(session, [("no call here", {}), ("still nothing", {}), ("nope", {})])
    b = episode_behaviour(hist, session.termination, 0.0)
    assert session.termination == "parse_error_limit"
    assert b["failure_layer"] == "interface" and b["interface_errors"] == 3


def test_basic_failure_submits_without_editing(session):
    hist = play(session, [("read_file", {"path": "bsearch.py"}), ("submit", {})])
    b = episode_behaviour(hist, session.termination, 0.0)
    assert b["failure_layer"] == "basic" and b["read_file"] and b["edits"] == 0


def test_sequential_failure_fixes_one_bug_and_submits(session):
    hist = play(session, [("read_file", {"path": "bsearch.py"}),
                          ("str_replace", {"path": "bsearch.py", "old": "low = mid\n", "new": "low = mid + 1\n"}),
                          ("submit", {})])
    b = episode_behaviour(hist, session.termination, 0.0)
    assert b["failure_layer"] == "sequential" and b["edits"] == 1
    assert not b["ran_tests_before_submit"]
    assert episode_behaviour(hist, session.termination, 1.0)["failure_layer"] is None


def test_layers_use_the_bugs_fixed_and_the_last_test_run(tmp_path):
    """A wrong edit submitted is basic (no progress), whatever came after it; one bug of two
    is sequential, with or without a failing test run before the submit (did not recover)."""
    from jaxrl_agent.agent.evaluation import bugs_fixed
    from jaxrl_agent.env.sandbox import Sandbox

    task = binary_search_task()
    path = task.metadata["source_file"]
    with Sandbox(num_workers=1, timeout_s=10) as sb:
        def run(i, calls):
            ws = create_workspaces(workspace_files(task), str(tmp_path / str(i)), 1)[0]
            s = ToolSession(Tools(ws, sorted(task.dev_tests), sb, ToolConfig(test_timeout_s=0.05)), ToolConfig())
            hist = play(s, calls)
            with open(f"{ws}/{path}") as f:
                return episode_behaviour(hist, s.termination, 0.0, bugs_fixed(task, {path: f.read()}))

        wrong = ("replace_lines", {"path": path, "start": 10, "end": 10, "text": "            low = mid + 2"})
        one = ("replace_lines", {"path": path, "start": 10, "end": 10, "text": "            low = mid + 1"})
        b = run(0, [wrong, ("submit", {})])
        assert b["failure_layer"] == "basic" and (b["bugs_fixed"], b["bugs_total"]) == (0, 2)
        assert run(1, [one, ("submit", {})])["failure_layer"] == "sequential"
        # a failing run after a wrong edit, then submit: still no progress, so basic (§9b)...
        b = run(2, [wrong, ("run_tests", {}), ("submit", {})])
        assert b["saw_failing_tests"] and b["failure_layer"] == "basic"
        # ...while after one bug of two fixed it is the decision not to recover
        other = ("replace_lines", {"path": path, "start": 12, "end": 12, "text": "            high = mid - 1"})
        b = run(4, [other, ("run_tests", {}), ("submit", {})])  # the dev tests see the bug left
        assert b["saw_failing_tests"] and b["failure_layer"] == "sequential" and b["bugs_fixed"] == 1
        assert run(3, [("run_tests", {}), ("run_tests", {}), ("submit", {})])["failure_layer"] == "basic"


def test_pass_at_k_curve_from_per_task_counts():
    from jaxrl_agent.agent.evaluation import pass_at_k_curve

    curve = pass_at_k_curve({"a": [1, 8], "b": [0, 8], "c": [8, 8], "d": [1, 2]}, ks=(1, 2, 8))
    assert curve["pass1"]["value"] == pytest.approx((1 / 8 + 0 + 1 + 1 / 2) / 4)
    assert curve["pass2"]["value"] == pytest.approx((pass_at_k(8, 1, 2) + 0 + 1 + 1) / 4)
    assert curve["pass8"]["n_tasks"] == 3 and curve["pass8"]["value"] == pytest.approx(2 / 3)
    assert curve["pass8"]["ci_low"] < 2 / 3 < curve["pass8"]["ci_high"]


def test_summary_counts_per_template():
    def ep(task, tpl, r):
        beh = {"turns": 2, "edits": 1, "ran_tests_before_submit": r > 0, "read_file": True, "recovered": False,
               "interface_errors": 0, "tool_errors": 0, "failure_layer": None if r else "sequential"}
        return Episode([1, 2], [0, 1], [0.0, -1.0], [0, 0], reward=r, termination="submitted",
                       info={"task_id": task, "template": tpl, "behaviour": beh})

    eps = [ep("a", "x", 1.0), ep("a", "x", 0.0), ep("b", "y", 0.0), ep("b", "y", 0.0)]
    s = summarize_episodes(eps, k=2)
    assert s["pass1"] == 0.25 and s["pass2"] == pytest.approx(0.5)
    assert s["per_task"] == {"a": [1, 2], "b": [0, 2]}
    assert s["per_template"]["x"]["pass1"] == 0.5 and s["per_template"]["y"]["pass1"] == 0.0
    assert s["behaviour"]["failure_layers"]["sequential"] == 0.75
    assert math.isclose(s["behaviour"]["ran_tests_before_submit"], 0.25)


def test_bugs_fixed_counts_each_injected_bug_from_the_final_source():
    from jaxrl_agent.agent.evaluation import bugs_fixed
    from jaxrl_agent.env.tasks import binary_search_task

    task = binary_search_task()
    path = task.metadata["source_file"]
    buggy = task.files[path]
    assert bugs_fixed(task, {path: buggy}) == (0, 2)
    one = buggy.replace("low = mid\n", "low = mid + 1\n")
    assert bugs_fixed(task, {path: one}) == (1, 2)
    assert bugs_fixed(task, {path: task.reference_files[path]}) == (2, 2)
    # a different (wrong) edit of the line is not a fix; a missing file fixes nothing
    assert bugs_fixed(task, {path: buggy.replace("low = mid\n", "low = mid + 2\n")}) == (0, 2)
    assert bugs_fixed(task, {}) == (0, 2)
    # free metadata of a user's task file never crashes the count: unknown is (0, 0)
    for meta in ({"bugs": 2}, {"bugs": [1, 2]}, {"bugs": [{"buggy": 1}]}, {"bugs": None}, {}):
        task.metadata = {**meta, "source_file": path}
        assert bugs_fixed(task, {path: buggy}) == (0, 0)
    task.metadata = {"bugs": [{"buggy": "x", "fixed": "y"}], "source_file": ["not", "a", "path"]}
    assert bugs_fixed(task, {path: buggy}) == (0, 1)


def test_bug_outcomes_say_fixed_untouched_or_changed_per_site_and_count_stray_lines():
    """Each injected bug is fixed, left as injected, or changed some other way; a line the
    policy wrote that neither the reference nor the starting file holds is stray, and stray
    lines beyond the changed sites' are edits made somewhere else (a wrong place chosen)."""
    from jaxrl_agent.agent.evaluation import bug_outcomes
    from jaxrl_agent.env.tasks import binary_search_task

    task = binary_search_task()
    path = task.metadata["source_file"]
    buggy = task.files[path]
    sites = [f"bsearch_find/{s[0]}" for s in task.metadata["bug_sites"]]
    assert len(sites) == 2
    o = bug_outcomes(task, {path: buggy})
    assert o == {"sites": sites, "outcomes": ["untouched", "untouched"], "stray_lines": 0, "elsewhere": 0}
    first = task.metadata["bugs"][0]
    one = buggy.replace(first["buggy"], first["fixed"])
    assert bug_outcomes(task, {path: one})["outcomes"] == ["fixed", "untouched"]
    assert bug_outcomes(task, {path: task.reference_files[path]})["outcomes"] == ["fixed", "fixed"]
    wrong = buggy.replace(first["buggy"], first["buggy"].replace("\n", " + 2\n"))
    o = bug_outcomes(task, {path: wrong})
    assert o["outcomes"] == ["changed", "untouched"] and o["stray_lines"] == 1 and o["elsewhere"] == 0
    # a correct line rewritten: both sites untouched, one stray line somewhere else
    elsewhere = buggy.replace("    return -1\n", "    return 0\n")
    assert elsewhere != buggy
    o = bug_outcomes(task, {path: elsewhere})
    assert o["outcomes"] == ["untouched", "untouched"] and (o["stray_lines"], o["elsewhere"]) == (1, 1)
    # a missing file: every bug changed (not fixed, not left as it was), nothing stray to count
    assert bug_outcomes(task, {})["outcomes"] == ["changed", "changed"]
    for meta in ({"bugs": 2}, {"bugs": [{"buggy": 1}]}, {}):  # a user's free metadata: unknown
        task.metadata = {**meta, "source_file": path}
        assert bug_outcomes(task, {path: buggy}) is None


def test_summary_counts_bug_outcomes_per_site():
    def ep(sites, outcomes, elsewhere, r):
        beh = {"turns": 2, "edits": 1, "ran_tests_before_submit": True, "read_file": True, "recovered": False,
               "interface_errors": 0, "tool_errors": 0, "failure_layer": None if r else "sequential",
               "bug_sites": {"sites": sites, "outcomes": outcomes, "stray_lines": elsewhere,
                             "elsewhere": elsewhere}}
        return Episode([1, 2], [0, 1], [0.0, -1.0], [0, 0], reward=r, termination="submitted",
                       info={"task_id": "t", "template": "x", "behaviour": beh})

    eps = [ep(["x/0", "x/1"], ["fixed", "fixed"], 0, 1.0), ep(["x/0", "x/1"], ["fixed", "untouched"], 1, 0.0),
           ep(["x/1"], ["changed"], 0, 0.0), ep(["x/1"], ["untouched"], 0, 0.0)]
    eps[-1].termination = "max_tokens"
    s = summarize_episodes(eps, k=1)["bug_sites"]
    assert s["per_site"]["x/0"] == {"bugs": 2, "fixed": 1.0, "untouched": 0.0, "changed": 0.0}
    assert s["per_site"]["x/1"] == {"bugs": 4, "fixed": 0.25, "untouched": 0.5, "changed": 0.25}
    # failed: a correct line rewritten (and a site left: the rewrite comes first), a site changed
    # wrongly, a site left as injected by an episode that ran out of tokens
    assert s["failed_episodes"] == 3
    third = pytest.approx(1 / 3)
    assert s["failed_with"] == {"site_changed_wrongly": third, "line_elsewhere_rewritten": third,
                                "site_left_as_injected": third, "every_site_fixed": 0.0}
    assert s["failed_not_submitted"] == {"site_changed_wrongly": 0.0, "line_elsewhere_rewritten": 0.0,
                                         "site_left_as_injected": third, "every_site_fixed": 0.0}
    # episodes without bug records (a user's tasks) add no table
    for e in eps:
        del e.info["behaviour"]["bug_sites"]
    assert "bug_sites" not in summarize_episodes(eps, k=1)
