"""benchmarks/profile_decode.py's trace readings on a hand-made trace: the time with no, one,
or several kernels running, and how much of a role's kernel time another kernel shared."""
import gzip
import json

import pytest
from bench_modules import load


@pytest.fixture(scope="module")
def prof():
    return load("profile_decode")


def _trace(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", **e} for e in events]}, f)
    return str(tmp_path)


# Two threads. Thread 1: matmul A 0-10, then matmul B 30-40. Thread 2: a reduction 5-15 (beside A
# for 5 of its 10 us), a copy 50-60. A while loop (a container) spans everything; a host event
# (Python frame) sits in the gap: neither is a kernel run.
EVENTS = [
    {"name": "ynn_fusion.1", "ts": 0, "dur": 10, "tid": 1},
    {"name": "ynn_fusion.2", "ts": 30, "dur": 10, "tid": 1},
    {"name": "ynn_fusion.3", "ts": 5, "dur": 10, "tid": 2},
    {"name": "copy.4", "ts": 50, "dur": 10, "tid": 2},
    {"name": "while.5", "ts": 0, "dur": 60, "tid": 3},
    {"name": "$python_frame", "ts": 20, "dur": 5, "tid": 1},
]
NAMES = {"ynn_fusion.1": "dot_general", "ynn_fusion.2": "closed_call/dot_general", "ynn_fusion.3": "reduce_sum"}


def test_occupancy_splits_the_span_by_kernels_running(prof, tmp_path):
    occ = prof.occupancy(_trace(tmp_path, EVENTS))
    # 0-5 A alone, 5-10 A and the reduction, 10-15 the reduction, 15-30 nothing, 30-40 B,
    # 40-50 nothing, 50-60 the copy
    assert occ == {"span_us": 60, "idle_us": 25, "one_kernel_us": 30, "two_or_more_us": 5}


def test_overlap_counts_the_other_threads_kernels(prof, tmp_path):
    ov = prof.overlap(_trace(tmp_path, EVENTS), NAMES)
    assert ov["runs"] == 2 and ov["mean_us"] == 10
    assert ov["overlapped_share"] == pytest.approx(5 / 20)  # A shared 5 of its 10 us, B none
    assert ov["alone_runs"] == 1 and ov["alone_mean_us"] == 10 and ov["beside_another_mean_us"] == 10
    only_reduction = prof.overlap(_trace(tmp_path / "r", EVENTS), NAMES, role="reductions (RMSNorm, softmax, sampling)")
    assert only_reduction["runs"] == 1 and only_reduction["overlapped_share"] == pytest.approx(0.5)
