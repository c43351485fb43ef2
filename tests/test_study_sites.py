"""The per-bug-site table (experiments/binary_search_rl/sites.py): site names, the tables, and
the command's argument errors; the tiny study in test_study.py runs it on a real policy."""
import pytest

from experiments.binary_search_rl.sites import failed_rows, main, paired_rows, site_line, sites_markdown


def test_site_line_names_the_line_a_site_should_read():
    assert site_line("bsearch_find/0") == "bsearch_find: `{lo} = {mid} + 1`"
    assert site_line("first_occurrence/2") == "first_occurrence: `else: ↵ {hi} = {mid} - 1`"
    for unknown in ("nope/1", "bsearch_find/99", "bsearch_find/x", "?"):
        assert site_line(unknown) == unknown


def test_tables_show_each_policys_sites_and_failures():
    def entry(pass1, fixed):
        return {"pass1": pass1, "bug_sites": {
            "per_site": {"bsearch_find/0": {"bugs": 4, "fixed": fixed, "untouched": 1 - fixed, "changed": 0.0}},
            "failed_episodes": 2,
            "failed_with": {"site_left_as_injected": 0.5, "line_elsewhere_rewritten": 0.5},
            "failed_not_submitted": {"site_left_as_injected": 0.5}}}

    md = sites_markdown({"sft": entry(0.5, 0.25), "rl": entry(0.75, 1.0)})
    assert "| bsearch_find: `{lo} = {mid} + 1` | 0.25 / 0.75 / 0.00 (4) | 1.00 / 0.00 / 0.00 (4) |" in md
    assert "| sft (pass@1 0.500) | 2 | 0.00 (0.00) | 0.50 (0.00) | 0.50 (0.50) | 0.00 (0.00) |" in md
    rows = failed_rows([("x", {})], "held-out")
    assert rows[0].startswith("| held-out: what their sites show") and rows[-1] == "| x | 0 |" + " 0.00 (0.00) |" * 4


def test_command_names_its_expected_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["just_a_dir"])
    assert "expected name=policy_dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["a=b", "--tasks=0"])
    assert "--tasks and --samples must be >= 1" in capsys.readouterr().err


def test_each_policy_is_paired_by_task_with_the_first():
    """The same validation instances for every policy: each one's per-task pass rates minus the
    first policy's, with the bootstrap interval; a policy on other tasks is an error."""
    result = {"sft": {"pass1": 0.25, "per_task": {"a": [0, 4], "b": [2, 4], "c": [1, 4], "d": [1, 4]}},
              "rl": {"pass1": 0.625, "per_task": {"a": [2, 4], "b": [4, 4], "c": [2, 4], "d": [2, 4]}}}
    rows = paired_rows(result)
    assert rows[0].startswith("| policy | pass@1 | minus sft, paired by task")
    assert rows[2] == "| sft | 0.250 | - |"
    assert rows[3] == "| rl | 0.625 | +0.375 [+0.250, +0.500] (p 0.125, 4 tasks) |"
    assert paired_rows({"sft": result["sft"]}) == []  # nothing to pair
    result["rl"]["per_task"] = {"a": [2, 4]}
    with pytest.raises(ValueError, match="rl and sft were sampled on different tasks"):
        paired_rows(result)
