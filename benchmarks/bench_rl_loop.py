"""Seconds per RL iteration of the whole loop (rollouts, verifier, update, engine refresh), three
ways side by side on this machine:

  sync        one process on every core, the synchronous loop (rl.max_staleness=0)
  one_off     one process on every core, one-step-off-policy rollouts (rl.max_staleness=1)
  two_procs   two processes joined by jax.distributed on localhost, each pinned to one core
              (taskset) with half the sandbox workers, each rolling out half the episodes

Workload: the shipped demo policy on generated training tasks, 2 tasks x 8 episodes an
iteration, one update over the 16 episodes. Each configuration runs in a fresh process, in
turn, `--repeats` times. The steady-state iteration leaves out the first iteration (compiles;
in one_off it also holds the one rollout nothing overlaps) and, for one_off, the last one
(nothing left to prefetch, so it is an update alone).

    python benchmarks/bench_rl_loop.py [--iterations=5] [--repeats=2]   -> benchmarks/results/rl_loop.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
POLICY = os.path.join(ROOT, "jaxrl_agent", "assets", "demo_policy")


def worker(mode: str, iterations: int, run_dir: str, out: str) -> None:
    """One run of train_rl; process 0 writes the wall time of each iteration to `out`."""
    from jaxrl_agent.train import sharding as sh

    sh.initialize_distributed()
    import jax

    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.config import OptimConfig, RLConfig, RolloutConfig, TrainConfig, TrajectoryConfig
    from jaxrl_agent.loops.rl import train_rl
    from jaxrl_agent.sampling.engine_config import agent_sampling

    model, tok = load_policy(POLICY)
    stamps = [time.perf_counter()]
    res = train_rl(model, tok, rl=RLConfig(iterations=iterations, tasks_per_iter=2, eval_tasks=2, eval_samples=1,
                                           eval_every=0, num_train_tasks=64, run_dir=run_dir, checkpoint_every=1000,
                                           require_signal=False, max_staleness=int(mode == "one_off"),
                                           sandbox_workers=2 // jax.process_count()),
                   rollout=RolloutConfig(group_size=8), sampling=agent_sampling(), train=TrainConfig(),
                   optim=OptimConfig(learning_rate=1e-5), traj=TrajectoryConfig(buckets=(512, 768, 1024)),
                   show_progress=False, on_iteration=lambda it, m: stamps.append(time.perf_counter()))
    if jax.process_index() == 0:
        last = res["iterations"][-1]
        with open(out, "w") as f:
            json.dump({"iteration_s": [b - a for a, b in zip(stamps, stamps[1:])],
                       "time": {k[5:]: v for k, v in last.items() if k.startswith("time/")},
                       "episodes": last["rollout/groups"] * 8, "success": last["rollout/success"]}, f)


def steady_iterations(mode: str, res: dict) -> list[float]:
    """Seconds of the iterations that are neither the first nor (one_off) the last."""
    return res["iteration_s"][1:-1] if mode == "one_off" else res["iteration_s"][1:]


def launch(mode: str, iterations: int, root: str) -> dict:
    out = os.path.join(root, f"{mode}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, str(iterations),
           tempfile.mkdtemp(dir=root), out]
    if mode == "two_procs":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for pid in range(2):
            e = dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
                     JAX_PLATFORMS="cpu")
            procs.append(subprocess.Popen(["taskset", "-c", str(pid % os.cpu_count()), *cmd], env=e))
    else:
        procs = [subprocess.Popen(cmd, env=env)]
    for p in procs:
        if p.wait(timeout=1800):
            raise RuntimeError(f"{mode}: a worker exited with {p.returncode}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "rl_loop.json"))
    args = ap.parse_args()
    modes = ("sync", "one_off", "two_procs")
    runs: dict[str, list] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="jxa-bench-rl-") as root:
        for r in range(args.repeats):
            for m in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order between repeats
                res = launch(m, args.iterations, root)
                runs[m].append(res)
                steady = steady_iterations(m, res)
                print(f"repeat {r} {m:9s} s/iter {sum(steady) / len(steady):.2f}  ({[round(x, 2) for x in steady]})",
                      flush=True)

    def mean_iter(m, res):
        steady = steady_iterations(m, res)
        return sum(steady) / len(steady)

    per = {m: sorted(mean_iter(m, x) for x in runs[m]) for m in modes}
    summary = {m: {"s_per_iteration": per[m], "median": per[m][len(per[m]) // 2]} for m in modes}
    for m in modes[1:]:
        ratios = sorted(mean_iter("sync", a) / mean_iter(m, b) for a, b in zip(runs["sync"], runs[m]))
        summary[m]["speedup_vs_sync"] = ratios
    out = {"config": vars(args), "cpus": os.cpu_count(), "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for m in modes:
        sp = summary[m].get("speedup_vs_sync")
        print(f"{m:9s} median s/iter {summary[m]['median']:.2f}" + (f"  vs sync {[round(x, 2) for x in sp]}x" if sp else ""))
    print(f"-> {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
