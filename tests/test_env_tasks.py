"""Task generation invariants, the canonical task, splits, JSONL io."""
import ast
import json

import pytest

from jaxrl_agent.env import tasks as T
from jaxrl_agent.env.tasks import (Task, TaskFormatError, binary_search_task, generate_tasks,
                                   load_tasks, save_tasks, task_from_dict, task_to_dict)
from jaxrl_agent.env.templates import HELDOUT_TEMPLATES, TEMPLATES, TRAIN_TEMPLATES


def _fails(src, fn, kind_args_expected):
    status, got = T._call(src, fn, kind_args_expected[1])
    return status != "ok" or not T.same(got, kind_args_expected[2])


def _cases_of(test_src: str, fn: str):
    """(kind, args, expected) back from a rendered test file, via its AST."""
    out = []
    for node in ast.walk(ast.parse(test_src)):
        if isinstance(node, ast.Assert):
            test = node.test
            if isinstance(test, ast.Call):  # _same(fn(*args), expected)
                call, expected = test.args
            else:  # fn(*args) == expected
                call, expected = test.left, test.comparators[0]
            assert call.func.id == fn
            out.append(("k", tuple(ast.literal_eval(a) for a in call.args),
                        ast.literal_eval(expected)))
    return out


# ---- the canonical task ----


def test_binary_search_task_has_the_two_boundary_bugs():
    t = binary_search_task()
    src = t.files["bsearch.py"]
    assert "low = mid\n" in src and "high = mid\n" in src
    assert "low = mid + 1" in t.reference_files["bsearch.py"]
    assert "high = mid - 1" in t.reference_files["bsearch.py"]
    assert set(t.files) == set(t.reference_files) == {"bsearch.py"}
    assert t.metadata["n_bugs"] == 2 and t.task_id == "binary_search"
    # Dev tests are partial: the `high = mid` bug alone passes them all.
    only_high = src.replace("low = mid\n", "low = mid + 1\n")
    dev = t.dev_tests["test_bsearch.py"]
    assert dev.count("def test_") == 3
    ns = {}
    exec(only_high, ns)
    for line in dev.splitlines():
        if line.strip().startswith("assert"):
            exec(line.strip(), {"binary_search": ns["binary_search"]})
    hidden = t.hidden_tests["test_bsearch_hidden.py"]
    for kind in ("absent", "empty", "one_element", "first", "last"):
        assert f"def test_{kind}" in hidden
    assert binary_search_task() == t  # deterministic


# ---- the family ----


def test_enough_templates_and_disjoint_splits():
    assert len(TEMPLATES) >= 15
    assert set(TRAIN_TEMPLATES).isdisjoint(HELDOUT_TEMPLATES)
    assert set(TRAIN_TEMPLATES) | set(HELDOUT_TEMPLATES) == set(TEMPLATES)
    families = {t.family for t in TEMPLATES.values()}
    assert {"binary_search", "ranges", "windows", "two_pointers", "partitioning", "clamping",
            "merging", "rotating", "chunking"} <= families


@pytest.mark.parametrize("split", T.SPLITS)
def test_generation_invariants_over_many_seeds(split):
    seen_ids = set()
    for seed in range(4):
        for task in generate_tasks(split, 25, seed):
            m = task.metadata
            assert m["split"] == split and 1 <= m["n_bugs"] <= 3
            assert (m["template"] in HELDOUT_TEMPLATES) == (split == "heldout_templates")
            assert task.task_id not in seen_ids
            seen_ids.add(task.task_id)
            src, fn = m["source_file"], m["fn"]
            buggy, ref = task.files[src], task.reference_files[src]
            assert buggy != ref and len(m["bugs"]) == m["n_bugs"]
            hidden = _cases_of(next(iter(task.hidden_tests.values())), fn)
            assert hidden and len(hidden) == len(m["hidden_kinds"])
            assert not any(_fails(ref, fn, c) for c in hidden), "reference must pass"
            assert any(_fails(buggy, fn, c) for c in hidden), "buggy must fail"
            for bug in m["bugs"]:  # every bug alone is caught by the hidden tests
                one = ref.replace(bug["fixed"], bug["buggy"], 1)
                assert one != ref and any(_fails(one, fn, c) for c in hidden)
            assert len(m["dev_kinds"]) >= 1 and set(m["dev_kinds"]) <= set(m["hidden_kinds"])


def test_dev_tests_fail_on_buggy_code_and_pass_on_reference():
    for task in generate_tasks("train", 30, 11) + generate_tasks("heldout_templates", 8, 11):
        fn, src = task.metadata["fn"], task.metadata["source_file"]
        dev = _cases_of(next(iter(task.dev_tests.values())), fn)
        assert 1 <= len(dev) <= 4
        assert not any(_fails(task.reference_files[src], fn, c) for c in dev)
        assert any(_fails(task.files[src], fn, c) for c in dev), task.task_id


def test_generation_is_deterministic_and_splits_differ():
    a = generate_tasks("train", 20, 7)
    assert [task_to_dict(t) for t in a] == [task_to_dict(t) for t in generate_tasks("train", 20, 7)]
    b = generate_tasks("heldout_instances", 20, 7)
    assert {t.task_id for t in a}.isdisjoint(t.task_id for t in b)
    assert {t.metadata["template"] for t in a} == set(TRAIN_TEMPLATES)
    assert generate_tasks("train", 20, 8)[0].task_id != a[0].task_id


def test_identifiers_and_layout_are_randomised():
    tasks = generate_tasks("train", 60, 0)
    assert len({t.metadata["fn"] for t in tasks}) > 20
    assert len({t.metadata["module"] for t in tasks}) > 8
    assert len({t.metadata["n_bugs"] for t in tasks}) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown split"):
        generate_tasks("test", 3, 0)
    with pytest.raises(ValueError, match="non-negative"):
        generate_tasks("train", -1, 0)
    assert generate_tasks("train", 0, 0) == []


def test_infinite_loop_is_caught_in_process():
    assert T._call("def f():\n    while True:\n        pass\n", "f", ())[0] == "loop"
    assert T._call("def f():\n    return 1 / 0\n", "f", ())[0] == "error"


# ---- JSONL ----


def test_jsonl_roundtrip(tmp_path):
    tasks = [binary_search_task()] + generate_tasks("heldout_templates", 5, 1)
    path = tmp_path / "tasks.jsonl"
    save_tasks(path, tasks)
    assert load_tasks(path) == tasks


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.pop("files"), "'files'"),
    (lambda d: d.update(task_id=""), "'task_id'"),
    (lambda d: d.update(instruction=3), "'instruction'"),
    (lambda d: d.update(hidden_tests={}), "'hidden_tests'"),
    (lambda d: d.update(files={"../evil.py": "x"}), "'files'"),
    (lambda d: d.update(files={"/abs.py": "x"}), "'files'"),
    (lambda d: d.update(dev_tests={"t.py": 3}), "'dev_tests'"),
    (lambda d: d.update(reference_files={"other.py": "x"}), "'reference_files'"),
    (lambda d: d.update(metadata=[1]), "'metadata'"),
    (lambda d: d.update(surprise=1), "surprise"),
    (lambda d: d.update(hidden_tests={"bsearch.py": "x"}), "'hidden_tests'"),
])
def test_malformed_task_is_rejected_naming_the_field(tmp_path, mutate, field):
    d = task_to_dict(binary_search_task())
    mutate(d)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(task_to_dict(binary_search_task()) | {"task_id": "ok"}) + "\n"
                    + json.dumps(d) + "\n")
    with pytest.raises(TaskFormatError, match=field) as e:
        load_tasks(path)
    assert "bad.jsonl:2" in str(e.value)


def test_malformed_json_and_duplicates(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(TaskFormatError, match="bad.jsonl:1: invalid JSON"):
        load_tasks(path)
    line = json.dumps(task_to_dict(binary_search_task()))
    path.write_text(line + "\n\n" + line + "\n")
    with pytest.raises(TaskFormatError, match="bad.jsonl:3: field 'task_id'"):
        load_tasks(path)
    with pytest.raises(TaskFormatError, match="JSON object"):
        task_from_dict([1, 2])
    assert isinstance(task_from_dict(task_to_dict(binary_search_task())), Task)


def test_generated_tasks_are_made_when_read_and_equal_generate_tasks():
    """GeneratedTasks (the RL loop's default tasks) reads task i alone, in any order, and its
    tasks are generate_tasks' (the same ids, files and tests)."""
    from jaxrl_agent.env.tasks import GeneratedTasks

    want = generate_tasks("train", 12, 3)
    lazy = GeneratedTasks("train", 12, 3)
    assert len(lazy) == 12 and not lazy._made
    assert lazy[7] == want[7] and set(lazy._made) == {7}
    assert lazy[-1] == want[-1] and lazy[2:5] == want[2:5]
    assert [t.task_id for t in lazy] == [t.task_id for t in want]
    with pytest.raises(IndexError):
        lazy[12]
    with pytest.raises(ValueError, match="unknown split"):
        GeneratedTasks("tarin", 3, 0)
