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
