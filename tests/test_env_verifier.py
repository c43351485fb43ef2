"""Verifier integrity: reward 1.0 only for a real fix; every known cheat gets 0.0."""
import dataclasses
import os
import random
import sys

import pytest

from jaxrl_agent.env import jail
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import (TaskFormatError, binary_search_task, generate_tasks, make_instance,
                                   save_tasks, task_from_dict)
from jaxrl_agent.env.templates import TEMPLATES
from jaxrl_agent.env.tools import create_workspaces
from jaxrl_agent.env.verifier import check_task, load_checked_tasks, verify

TASK = binary_search_task()
SRC = "bsearch.py"
FIXED = TASK.reference_files[SRC]
BUGGY = TASK.files[SRC]


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=2, timeout_s=10, memory_mb=512) as s:
        yield s


@pytest.fixture
def ws(tmp_path):
    return create_workspaces({**TASK.files, **TASK.dev_tests}, str(tmp_path), 1)[0]


def put(ws, text, name=SRC):
    with open(os.path.join(ws, name), "w") as f:
        f.write(text)


def check(sb, ws, reason=None, timeout_s=10.0):
    res = verify(TASK, ws, sb, timeout_s=timeout_s)
    assert res.reward == 0.0, res.info
    if reason is not None:
        assert res.info["reason"] == reason, res.info
    return res


# ---- honest outcomes ----


def test_fixed_gets_one(sb, ws):
    put(ws, FIXED)
    res = verify(TASK, ws, sb)
    assert res.reward == 1.0 and res.info["reason"] == "passed"
    assert res.info["passed"] == res.info["expected"] == len(TASK.metadata["hidden_kinds"])


def test_buggy_gets_zero_and_lists_failures(sb, ws):
    res = check(sb, ws, "failed")
    assert res.info["failures"] and res.info["missing"]


def test_one_bug_fixed_is_not_enough(sb, ws):
    put(ws, BUGGY.replace("low = mid\n", "low = mid + 1\n"))
    check(sb, ws, "failed")


def test_missing_source_file(sb, ws):
    os.unlink(os.path.join(ws, SRC))
    res = check(sb, ws)
    assert res.info["missing_sources"] == [SRC]


def test_default_sandbox_is_created_when_none_given(ws):
    put(ws, FIXED)
    assert verify(TASK, ws).reward == 1.0


def test_reference_fix_passes_every_generated_task(sb, tmp_path):
    tasks = (generate_tasks("train", 14, 3) + generate_tasks("heldout_instances", 4, 3)
             + generate_tasks("heldout_templates", 4, 3))
    assert len({t.metadata["template"] for t in tasks}) == 18
    for i, task in enumerate(tasks):
        fixed = create_workspaces({**task.reference_files, **task.dev_tests},
                                  str(tmp_path / f"f{i}"), 1)[0]
        res = verify(task, fixed, sb)
        assert res.reward == 1.0, (task.task_id, res.info)
        buggy = create_workspaces({**task.files, **task.dev_tests}, str(tmp_path / f"b{i}"), 1)[0]
        assert verify(task, buggy, sb).reward == 0.0, task.task_id


# ---- cheats: each must get 0.0 ----

HEAD = "import sys, os\n"


@pytest.mark.parametrize("prefix", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n",
                                    "raise SystemExit(0)\n"])
def test_exit_at_import(sb, ws, prefix):
    put(ws, prefix + BUGGY)
    check(sb, ws)


def test_conftest_and_ini_dropped_in_workspace(sb, ws):
    put(ws, "import pytest\n\ndef pytest_collection_modifyitems(items):\n    items.clear()\n"
            "\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n    return True\n",
        "conftest.py")
    put(ws, "[pytest]\naddopts = -p no:python --co\n", "pytest.ini")
    put(ws, "[tool.pytest.ini_options]\naddopts = '-k nothing'\n", "pyproject.toml")
    put(ws, "import builtins\n", "sitecustomize.py")
    check(sb, ws, "failed")


def test_edited_and_deleted_test_files(sb, ws):
    os.unlink(os.path.join(ws, "test_bsearch.py"))
    put(ws, "def test_nothing():\n    pass\n", "test_bsearch_hidden.py")
    check(sb, ws, "failed")


def test_monkeypatching_pytest_runtest(sb, ws):
    # The child's pytest is not the judge's: the patch changes nothing the verdict uses.
    put(ws, "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n" + BUGGY)
    assert check(sb, ws, "failed").info["tampered"] == []


def test_monkeypatching_pytest_reports(sb, ws):
    put(ws, "import _pytest.runner\n_orig = _pytest.runner.call_and_report\n"
            "def _fake(item, when, log=True, **kw):\n    return _orig(item, 'setup', log)\n"
            "_pytest.runner.call_and_report = _fake\n" + BUGGY)
    check(sb, ws)


def test_monkeypatching_unittest(sb, ws):
    put(ws, "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n" + BUGGY)
    check(sb, ws, "failed")


class _AlwaysEq:
    SRC = ("class _Eq(int):\n    def __eq__(self, other):\n        return True\n"
           "    __hash__ = int.__hash__\n\n"
           "def binary_search(arr, target):\n    return _Eq(0)\n")


def test_always_equal_object(sb, ws):
    put(ws, _AlwaysEq.SRC)
    check(sb, ws, "failed")


def test_patching_the_test_modules_helper(sb, ws):
    put(ws, "import sys\n\ndef binary_search(arr, target):\n"
            "    for name, mod in list(sys.modules.items()):\n"
            "        if name.endswith('_hidden'):\n"
            "            mod._same = lambda a, b: True\n"
            "    return 0\n")
    check(sb, ws, "failed")  # the test module lives in the judge: not in this sys.modules


def test_patching_builtins(sb, tmp_path):
    # A list-valued task: with builtins.all forced to True, any same-length list would
    # satisfy the hidden tests' exact comparison; the tamper check must catch it.
    task = make_instance(TEMPLATES["chunk"], random.Random(5))
    fn, src = task.metadata["fn"], task.metadata["source_file"]
    cheat = (f"import builtins, math\nbuiltins.all = lambda it: True\n\n"
             f"def {fn}(xs, size):\n    return [[0]] * math.ceil(len(xs) / size)\n")
    ws = create_workspaces({src: cheat}, str(tmp_path), 1)[0]
    res = verify(task, ws, sb)  # the child's builtins are not the judge's
    assert res.reward == 0.0 and res.info["reason"] == "failed", res.info


def test_infinite_loop(sb, ws):
    put(ws, "def binary_search(arr, target):\n    while True:\n        pass\n")
    res = check(sb, ws, "failed")
    assert "timed out" in res.info["failures"][0]["message"]


def test_sleeping_forever_hits_wall_timeout(sb, ws):
    put(ws, "import time\ntime.sleep(600)\n" + FIXED)
    res = verify(TASK, ws, sb, timeout_s=2)
    assert res.reward == 0.0 and res.info["reason"] == "timeout"


def _no_leftovers(sb):
    uids = range(sb.config.base_uid, sb.config.base_uid + sb.config.num_workers)
    return [p for u in uids for p in jail.uid_processes(u)] == []


def skip_unless_uid_drop(sb):
    if sb.isolation == "basic":  # never run a fork bomb with the caller's rights
        pytest.skip("fork-bomb containment needs the uid drop (root, level uid/namespaces)")


def test_fork_bomb_instead_of_a_fix(sb, ws):
    skip_unless_uid_drop(sb)
    put(ws, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n" + BUGGY)
    check(sb, ws, "timeout", timeout_s=3)
    assert _no_leftovers(sb)


def test_fork_bomb_that_replicates_the_test_session(sb, ws):
    skip_unless_uid_drop(sb)
    # Every copy finishes the import inside the code server; only the original answers
    # (copies exit instead of replying), so the verdict is the code's, forks or not.
    bomb = "import os\nfor _ in range(10):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    put(ws, bomb + FIXED)
    assert verify(TASK, ws, sb).reward == 1.0
    put(ws, bomb + BUGGY)
    check(sb, ws, "failed")
    assert _no_leftovers(sb)


def test_a_harmless_fork_does_not_cost_a_correct_fix(sb, ws):
    put(ws, "import os\nif os.fork() == 0:\n    os._exit(0)\n" + FIXED)
    assert verify(TASK, ws, sb).reward == 1.0


def test_memory_bomb(sb, ws):
    put(ws, "_hog = bytearray(8 * 1024 ** 3)\n" + FIXED)
    check(sb, ws, "collection_error")


READ_HIDDEN = r'''import glob, re
_ANSWERS = {}
for _path in glob.glob("**/test_*.py", recursive=True) + glob.glob("/**/test_*hidden*.py"):
    for _args, _exp in re.findall(r"binary_search\((.*)\), (-?\d+)\)", open(_path).read()):
        _ANSWERS[_args] = int(_exp)

def binary_search(arr, target):
    return _ANSWERS.get(f"{arr!r}, {target!r}", -2)
'''


def test_reading_hidden_tests_from_disk(sb, ws, tmp_path):
    put(ws, READ_HIDDEN)
    check(sb, ws, "failed")
    # The cheat is real: with the hidden tests on disk, it passes every one of them.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / SRC).write_text(READ_HIDDEN)
    for name, text in TASK.hidden_tests.items():
        (plain / name).write_text(text)
    r = sb.run(plain, [sys.executable, "-m", "pytest", "-q", *TASK.hidden_tests])
    assert r.returncode == 0 and "15 passed" in r.stdout, r.stdout


def test_forged_records(sb, ws):
    put(ws, "import os, json\nfor _i in range(20):\n    os.write(200, (json.dumps({'event': "
            "'test', 'id': 'test_bsearch_hidden.py::test_%d' % _i, 'outcome': 'passed'}) + "
            "'\\n').encode())\n" + BUGGY)
    check(sb, ws)


MALFORMED_RECORDS = """import gc
for _o in gc.get_objects():
    if type(_o).__name__ == "_Reporter":  # the reporter's own _emit adds the right nonce
        _o._emit(event="test", id=["x"], when=3, outcome={"passed": 1}, message=None)
        _o._emit(event="test", id="t::a", when="call", outcome="won", message="")
        _o._emit(event="end", exitstatus="0", tampered="nothing")
        _o._emit(event=7)
        break
""" + BUGGY


def test_records_of_unexpected_types_never_raise(sb, ws):
    """Records carrying the nonce but fields of the wrong type or shape are refused as forged:
    `verify` and `ToolSession.step(run_tests)` answer without raising."""
    from jaxrl_agent.env.sandbox_io import well_formed
    from jaxrl_agent.env.tools import ToolConfig, Tools, ToolSession, format_tool_call

    put(ws, MALFORMED_RECORDS)
    check(sb, ws, "failed")  # verify's child has no reporter to find: the code just fails
    step = ToolSession(Tools(ws, sorted(TASK.dev_tests), sb, ToolConfig()), ToolConfig()).step(
        format_tool_call("run_tests"))
    assert not step.done and isinstance(step.observation, str)
    r = sb.run(ws, [sys.executable, "-m", "pytest", "-q", *TASK.dev_tests], test_timeout_s=0.5)
    assert r.forged_records >= 4 and all(well_formed(t) for t in r.tests)


def test_record_schema():
    from jaxrl_agent.env.sandbox_io import well_formed

    good = {"event": "test", "id": "t.py::a", "when": "call", "outcome": "passed", "message": "", "pid": 3}
    assert well_formed(good) and well_formed({"event": "start", "pid": 1})
    assert well_formed({"event": "end", "exitstatus": 0, "tampered": ["x"], "pid": 1})
    for bad in ({**good, "outcome": "won"}, {**good, "pid": True}, {**good, "id": 5}, {**good, "extra": 1},
                {"event": "end", "exitstatus": 0, "tampered": [1], "pid": 1}, {"event": 7}, ["event"], {}):
        assert not well_formed(bad), bad


def test_check_task_for_user_tasks(sb):
    assert check_task(TASK, sb) == []
    solved = dataclasses.replace(TASK, task_id="solved", files=dict(TASK.reference_files))
    assert "already pass" in check_task(solved, sb)[0]
    broken = dataclasses.replace(TASK, task_id="broken", reference_files=dict(TASK.files))
    assert "reference solution does not pass" in check_task(broken, sb)[0]


def test_task_files_are_loaded_and_checked(sb, tmp_path):
    """What `--rl.train_file` / `--eval.task_file` read: good tasks come back; a missing or
    empty file, and a task whose reward cannot be trusted, are clear errors naming the cause."""
    good = str(tmp_path / "good.jsonl")
    save_tasks(good, [TASK])
    assert [t.task_id for t in load_checked_tasks(good, sb)] == [TASK.task_id]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checked_tasks(str(tmp_path / "missing.jsonl"), sb)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskFormatError, match="no tasks"):
        load_checked_tasks(str(tmp_path / "empty.jsonl"), sb)
    bad = str(tmp_path / "bad.jsonl")
    save_tasks(bad, [TASK, dataclasses.replace(TASK, task_id="solved", files=dict(TASK.reference_files))])
    with pytest.raises(TaskFormatError, match="(?s)1 problem.*task solved: the buggy files already pass"):
        load_checked_tasks(bad, sb)


USER_HIDDEN = """import pytest
from calc import add

CASES = [(a, b) for a in range(3) for b in range(3)]


@pytest.fixture
def base():
    return 10


@pytest.mark.parametrize("a,b", CASES)
def test_add(a, b):
    assert add(a, b) == a + b


def test_with_fixture(base, tmp_path):
    (tmp_path / "x").write_text("1")
    assert add(base, 1) == 11


class TestGroup:
    def test_negative(self):
        assert add(-1, -1) == -2

    def test_raises(self):
        with pytest.raises(TypeError):
            add(1, None)
"""


def test_user_task_with_pytest_features(sb, tmp_path):
    task = task_from_dict(dict(
        task_id="user-add", instruction="Fix add.", files={"calc.py": "def add(a, b):\n"
                                                                "    return a - b\n"},
        reference_files={"calc.py": "def add(a, b):\n    return a + b\n"},
        hidden_tests={"tests/test_calc_hidden.py": USER_HIDDEN}))
    assert check_task(task, sb) == []
    ws = create_workspaces(task.reference_files, str(tmp_path), 1)[0]
    res = verify(task, ws, sb)
    assert res.reward == 1.0 and res.info["expected"] == 9 + 1 + 2, res.info
