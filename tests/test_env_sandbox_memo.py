"""Identical sandbox calls share one execution (`sandbox_memo`), and nothing else does: a key
covers every byte the call copies and every part of the request; only clean results are kept."""
import os
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import CallMemo, workspace_digest
from jaxrl_agent.env.tasks import binary_search_task, workspace_files
from jaxrl_agent.env.verifier import verify

PY = sys.executable


def _ws(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


def test_digest_covers_what_the_sandbox_copies_and_nothing_else(tmp_path):
    a = _ws(tmp_path / "a", {"m.py": "x = 1\n", "pkg/t.py": "y = 2\n"})
    b = _ws(tmp_path / "b", {"m.py": "x = 1\n", "pkg/t.py": "y = 2\n"})
    base = workspace_digest(a)
    assert base is not None and workspace_digest(b) == base  # where it lives is not part of it
    (tmp_path / "b" / "m.py").write_text("x = 2\n")
    assert workspace_digest(b) != base  # a byte
    (tmp_path / "b" / "m.py").write_text("x = 1\n")
    os.chmod(tmp_path / "b" / "m.py", 0o755)
    assert workspace_digest(b) != base  # the executable bit is copied
    os.chmod(tmp_path / "b" / "m.py", 0o644)
    assert workspace_digest(b) == base
    os.makedirs(tmp_path / "b" / "empty")
    assert workspace_digest(b) != base  # an empty directory is copied
    os.rmdir(tmp_path / "b" / "empty")
    os.rename(tmp_path / "b" / "pkg" / "t.py", tmp_path / "b" / "pkg" / "u.py")
    assert workspace_digest(b) != base  # a name
    os.rename(tmp_path / "b" / "pkg" / "u.py", tmp_path / "b" / "pkg" / "t.py")
    os.symlink("/etc/passwd", tmp_path / "b" / "link.py")  # the copy skips links: so does the key
    os.symlink(str(tmp_path / "a"), tmp_path / "b" / "linkdir")
    assert workspace_digest(b) == base
    _ws(tmp_path / "big", {f"f{i}.py": "" for i in range(5)})
    assert workspace_digest(str(tmp_path / "big"), max_files=4) is None
    assert workspace_digest(str(tmp_path / "big"), max_bytes=0) is not None  # empty files


def _result(**kw):
    return SimpleNamespace(**{"error": None, "timed_out": False, "replace_worker": False, "stdout": "ok", **kw})


def test_memo_runs_each_key_once_keeps_only_clean_results_and_evicts_the_oldest():
    memo, runs = CallMemo(max_entries=2), []

    def run(**kw):
        def f():
            runs.append(kw)
            return _result(**kw)
        return f
    first = memo.call("k1", run(), wait_s=1)
    again = memo.call("k1", run(), wait_s=1)
    assert len(runs) == 1 and again.stdout == "ok" and again is not first  # a copy, not the object
    again.stdout = "changed by a caller"
    assert memo.call("k1", run(), wait_s=1).stdout == "ok"
    for bad in ({"error": "worker died"}, {"timed_out": True}, {"replace_worker": True}):
        runs.clear()
        memo.call("bad", run(**bad), wait_s=1)
        memo.call("bad", run(**bad), wait_s=1)
        assert len(runs) == 2, bad  # says nothing about the code: the next identical call runs
    runs.clear()
    memo.call(None, run(), wait_s=1)
    memo.call(None, run(), wait_s=1)
    assert len(runs) == 2  # no key (an undigestible workspace): always runs
    memo.call("k2", run(), wait_s=1)
    memo.call("k3", run(), wait_s=1)  # k1 is the oldest of three
    runs.clear()
    memo.call("k1", run(), wait_s=1)
    assert len(runs) == 1 and memo.hits >= 2
    with pytest.raises(ValueError, match="max_entries"):
        CallMemo(0)


def test_identical_calls_in_flight_share_one_execution():
    memo, runs, gate = CallMemo(), [], threading.Event()

    def slow():
        runs.append(1)
        gate.wait(5)
        return _result()
    out = []
    threads = [threading.Thread(target=lambda: out.append(memo.call("k", slow, wait_s=5))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join()
    assert len(runs) == 1 and len(out) == 4 and all(r.stdout == "ok" for r in out)


def test_sandbox_memo_reuses_identical_calls_and_reruns_changed_ones(tmp_path):
    ws = _ws(tmp_path / "ws", {"mod.py": "def f(x):\n    return x + 1\n",
                               "test_mod.py": "from mod import f\n\ndef test_ok():\n    assert f(1) == 2\n"})
    argv = [PY, "-m", "pytest", "-q", "test_mod.py"]
    with pytest.raises(ValueError, match="memo_entries"):
        Sandbox(num_workers=1, memo_entries=-1)
    with Sandbox(num_workers=1, timeout_s=10, memo_entries=16) as sb:
        first = sb.run(ws, argv)
        assert first.error is None and first.returncode == 0, first
        again = sb.run(ws, argv)
        assert (again.returncode, again.stdout, again.tests) == (first.returncode, first.stdout, first.tests)
        assert (sb.memo.runs, sb.memo.hits) == (1, 1)
        sb.run(ws, argv, test_timeout_s=0.5)  # another limit: another request
        sb.run(ws, [PY, "-m", "pytest", "test_mod.py"])  # another command
        assert (sb.memo.runs, sb.memo.hits) == (3, 1)
        with open(os.path.join(ws, "mod.py"), "w") as f:
            f.write("def f(x):\n    return x + 2\n")
        changed = sb.run(ws, argv)
        assert changed.returncode != 0 and sb.memo.runs == 4  # new bytes run again
        # a call that writes into its copy leaves the caller's workspace (so the key) as it was
        r = sb.run(ws, [PY, "-c", "open('mod.py', 'w').write('tampered')"])
        assert r.error is None and "tampered" not in open(os.path.join(ws, "mod.py")).read()
    with Sandbox(num_workers=1, timeout_s=10) as plain:
        assert plain.memo is None and plain.run(ws, argv).returncode == changed.returncode


def test_verdicts_through_the_memo_match_fresh_ones_and_depend_on_the_hidden_tests(tmp_path):
    """The same bytes under another task's hidden tests are another request."""
    task = binary_search_task()
    fixed = _ws(tmp_path / "fixed", {**workspace_files(task), **task.reference_files})
    buggy = _ws(tmp_path / "buggy", workspace_files(task))
    other = replace(task, task_id="other", hidden_tests={k: v + "\n\ndef test_always_fails():\n    assert False\n"
                                                         for k, v in task.hidden_tests.items()})
    with Sandbox(num_workers=2, timeout_s=20, memo_entries=64) as sb, Sandbox(num_workers=1, timeout_s=20) as fresh:
        for ws in (fixed, buggy, fixed, buggy):
            assert verify(task, ws, sb).reward == verify(task, ws, fresh).reward
        assert verify(task, fixed, sb).reward == 1.0 and verify(other, fixed, sb).reward == 0.0
        assert sb.memo.hits >= 2
