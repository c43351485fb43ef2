"""The study's independent stages side by side (experiments/binary_search_rl/parallel.py):
each call runs once, in another process with jobs > 1; a failed stage is named after the
others finished."""
import operator
import os
from pathlib import Path

import pytest

from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.parallel import StageError, run_stages


def test_run_stages_in_workers_returns_what_running_them_here_does(tmp_path):
    calls = [("sum", operator.add, (1, 2), {}), ("pid", os.getpid, (), {}),
             ("kw", int, ("17",), {"base": 8})]
    assert run_stages(1, calls) == {"sum": 3, "pid": os.getpid(), "kw": 15}
    out = run_stages(2, calls)
    assert out["sum"] == 3 and out["kw"] == 15 and out["pid"] != os.getpid()  # ran in a worker


def test_a_failed_stage_is_named_after_the_others_finish(tmp_path):
    done = tmp_path / "done.txt"
    calls = [("boom", operator.truediv, (1, 0), {}), ("written", Path.write_text, (done, "ok"), {})]
    with pytest.raises(StageError, match=r"'boom'.*ZeroDivisionError.*--jobs=1") as e:
        run_stages(2, calls)
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert done.read_text() == "ok"  # the other stage ran to its end
    with pytest.raises(ZeroDivisionError):  # here, the error itself, at once
        run_stages(1, calls)


def test_bad_jobs_and_repeated_names_are_refused():
    call = ("a", operator.add, (1, 2), {})
    with pytest.raises(ValueError, match="jobs=0: at least 1"):
        run_stages(0, [call])
    with pytest.raises(ValueError, match="unique"):
        run_stages(2, [call, call])
    with pytest.raises(ValueError, match="jobs=0: at least 1"):
        StudyConfig(jobs=0)


def _double(name: str):
    """A follow-up builder: one call that doubles the stage's result, named after it."""
    return lambda result: [(f"{name}_twice", operator.mul, (result, 2), {})]


def test_follow_ups_run_on_their_stage_result_in_the_same_pool():
    calls = [("a", operator.add, (1, 2), {}), ("b", operator.add, (10, 20), {})]
    then = {"a": _double("a"), "b": _double("b"), "a_twice": lambda r: [("pid", os.getpid, (), {})]}
    here = run_stages(1, calls, then)
    assert here == {"a": 3, "b": 30, "a_twice": 6, "b_twice": 60, "pid": os.getpid()}
    assert list(here) == ["a", "b", "a_twice", "b_twice", "pid"]  # calls, then follow-ups in order
    there = run_stages(2, calls, then)
    assert list(there) == list(here) and there["pid"] != os.getpid()  # chained follow-up in a worker
    assert {k: v for k, v in there.items() if k != "pid"} == {k: v for k, v in here.items() if k != "pid"}
    assert run_stages(2, calls, {"a": lambda r: []}) == {"a": 3, "b": 30}  # no follow-up


def test_a_failed_stage_has_no_follow_ups_and_the_others_still_run(tmp_path):
    done = tmp_path / "done.txt"
    calls = [("boom", operator.truediv, (1, 0), {}), ("ok", operator.add, (1, 1), {})]
    then = {"boom": _double("boom"), "ok": lambda r: [("written", Path.write_text, (done, str(r)), {})]}
    with pytest.raises(StageError, match=r"'boom'.*ZeroDivisionError") as e:
        run_stages(2, calls, then)
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert done.read_text() == "2"  # the other stage's follow-up ran; boom's could not


def test_a_follow_up_named_like_another_call_is_refused():
    calls = [("a", operator.add, (1, 2), {}), ("b", operator.add, (3, 4), {})]
    for jobs in (1, 2):
        with pytest.raises(ValueError, match=r"unique, got 'b' twice"):
            run_stages(jobs, calls, {"a": lambda r: [("b", operator.add, (r, 0), {})]})


def _spawned_children(parent: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmd:
                out.append(int(d))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_workers_end_when_the_study_process_is_killed():
    """A stopped study must not leave its workers running their stages, orphaned (they wrote
    into the work dir the next run used)."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import time\nfrom experiments.binary_search_rl.parallel import run_stages\n"
            "run_stages(2, [('a', time.sleep, (120,), {}), ('b', time.sleep, (120,), {})])\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1])
    children: list[int] = []
    try:
        deadline = time.time() + 60
        while len(children := _spawned_children(parent.pid)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(children) == 2, "the pool's two workers never started"
        time.sleep(3)  # past the workers' initializer
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        import select
        for c in children:  # wait for each worker's exit on its pidfd (no polling), 20 s at most
            try:
                fd = os.pidfd_open(c)
            except ProcessLookupError:
                continue
            select.select([fd], [], [], 20)
            os.close(fd)
        alive = [c for c in children if os.path.exists(f"/proc/{c}")
                 and Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not alive, f"workers {alive} outlived the killed study process"
    finally:
        parent.kill()
        for c in children:  # on a failure: no sleeping worker outlives the test
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass
