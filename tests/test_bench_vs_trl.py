"""benchmarks/bench_vs_trl.py at toy sizes: both sides run the same prompt ids on the same
weights (the checks the benchmark's ratios stand on), and every figure it reports exists."""
import json
import os

import pytest
from bench_modules import ROOT
from bench_modules import load as _bench


@pytest.mark.slow
def test_tiny_iteration_side_by_side(tmp_path):
    bench = _bench("bench_vs_trl")
    out = tmp_path / "vs_trl.json"
    res = bench.main(["--prompts=2", "--group=2", "--new=8", "--iterations=1", "--threads=1", f"--out={out}"])
    assert json.loads(out.read_text())["trl_best"] == "threads_1"
    assert res["logp_max_abs_diff"] < 1e-4  # our sampler's log-probs are transformers' on the same weights
    assert res["trl"]["threads_1"]["prompt_ids_equal"]
    assert len(res["passes"][0]["rows"]) == 2 and all("ours" in r and "trl" in r for r in res["passes"][0]["rows"])
    for side in (res["ours"], res["trl"]["threads_1"]):
        assert side["s"] > 0 and side["generation_s"] > 0 and side["update_s"] > 0 and side["new_tokens_per_s"] > 0
    assert set(res["speedup_vs_trl_best"]) == {"s", "generation_s", "update_s"}


@pytest.mark.slow
def test_tiny_agent_iteration_side_by_side(tmp_path):
    """The multi-turn workload: TRL's `rollout_func` runs our episode loop (tools, sandbox,
    verifier) on `TorchEngine`; both sides return whole episodes with their figures. At the
    study's settings: each side's own memoised sandbox, the 0.05 s test limit."""
    bench = _bench("bench_vs_trl_agent")
    res = bench.main(["--tasks=1", "--group=2", "--iterations=1", "--threads=1", "--settings=study",
                      f"--out={tmp_path / 'a.json'}"])
    assert res["config"]["settings"] == "study"
    assert set(res["episodes"]) == {"ours", "trl"} and all(v["turns"] >= 1 for v in res["episodes"].values())
    rows = res["passes"][0]["rows"]
    assert len(rows) == 2
    for r in rows:
        for side in ("ours", "trl"):
            assert r[side]["turns"] >= 1 and r[side]["tokens"] > r[side]["new_tokens"] > 0
            assert 0.0 <= r[side]["success"] <= 1.0
    assert set(res["speedup_vs_trl_best"]) == {"s", "generation_s", "update_s"}
    env = res["environment"]  # the verifier runs for every episode: the workers spent CPU on each side
    assert env["ours"]["env_cpu_s"] > 0 and env["trl"]["env_cpu_s"] > 0
    assert env["left_for_engine_and_update_s"] == pytest.approx(env["target_4x_s"] - env["env_floor_s"])


def test_worker_cpu_counts_the_children_a_worker_waited_for():
    """The environment's CPU (the agent benchmark's floor) includes the jailed runs a sandbox
    worker forks and waits for, not only the worker's own time."""
    import subprocess
    import sys

    bench = _bench("bench_vs_trl_agent")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    # the parent waits for a child that burns 0.4 s of CPU, says so, then blocks on its stdin
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                               f"subprocess.run([sys.executable, '-c', {burn!r}])\n"
                               "print('done', flush=True)\nsys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "done"
        assert 0.4 <= bench.worker_cpu_s([parent.pid]) < 5
    finally:
        parent.kill()
        parent.wait()


def test_torch_engine_rows_go_on_from_what_they_sampled():
    """TRL's side of the agent benchmark: a row's next turn sees its own earlier turn, as our
    engine's cache does (the rollout appends only observations). Without it every later turn
    was sampled after the observation with the call that caused it missing."""
    import transformers

    bench = _bench("bench_vs_trl_agent")
    from jaxrl_agent.config import SamplingConfig

    policy = os.path.join(ROOT, "jaxrl_agent", "assets", "demo_policy")
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    engine = bench.TorchEngine(model, SamplingConfig(batch_size=2, cache_size=64, stop_token_ids=()), pad_id=0)
    engine.start_episode(1, [5, 6, 7])
    engine.begin_turn([1], max_new_tokens=4)
    turn = engine.advance(4)
    ids, logp, _ = turn.row(1)
    assert len(ids) == len(logp) == 4 and turn.finish_reason == (None, "length")
    assert engine.rows[1] == [5, 6, 7, *ids]
    engine.append(1, [8, 9])
    assert engine.rows[1] == [5, 6, 7, *ids, 8, 9]


@pytest.mark.slow
def test_update_layouts_run_the_same_update(tmp_path):
    """benchmarks/bench_update_layouts.py at toy size: the three layouts' first losses agree
    (it raises otherwise) and each is timed; packing never runs more token slots than whole rows."""
    bench = _bench("bench_update_layouts")
    res = bench.main(["--tasks=1", "--group=2", "--repeats=1", f"--out={tmp_path / 'u.json'}"])
    assert set(res["median_s"]) == {"whole", "shared", "packed"} and all(v > 0 for v in res["median_s"].values())
    assert res["slots"]["packed"] <= res["slots"]["whole"]
    assert json.loads((tmp_path / "u.json").read_text())["episodes"] == 2
