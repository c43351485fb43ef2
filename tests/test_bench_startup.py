"""benchmarks/bench_startup.py's split of the wait, from a run's metrics.jsonl as the killed
demo leaves it (the timed runs themselves are the benchmark's, not a test's)."""
import json

import pytest
from bench_modules import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_startup")


def test_split_reads_iteration_one_and_leaves_the_rest(bench, tmp_path):
    lines = [{"step": 0, "time": 1.0, "probe/pass1": 0.5},
             {"step": 1, "time": 2.0, "time/rollout": 12.5, "time/reward": 0.25, "time/train": 7.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert bench._split(str(tmp_path), 30.0) == {"rollout": 12.5, "reward": 0.25, "train": 7.0, "rest": 10.25}
    lines[1]["time/compile"] = 9.5  # the RL loop's JAX compile seconds: reported beside the parts, not one of them
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert bench._split(str(tmp_path), 30.0) == {"rollout": 12.5, "reward": 0.25, "train": 7.0, "rest": 10.25,
                                                 "compile": 9.5}


def test_split_of_a_run_that_never_trained_is_empty(bench, tmp_path):
    assert bench._split(str(tmp_path), 30.0) == {}  # no metrics file yet
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "probe/pass1": 0.0}) + "\n")
    assert bench._split(str(tmp_path), 30.0) == {}  # the no-signal verdict: no iteration ran
