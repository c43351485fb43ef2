"""What a warm start pays to get a stored program back (HOST + DEVICE): the program store's
exported module (`program_store.StoredJit`: read, lower the exported call, XLA compile served
by JAX's persistent cache) against JAX's own serialized executable
(`jax.experimental.serialize_executable.deserialize_and_load`: machine code, no lowering).
Not built into the store: the figure says what that next step would save per program.

    python benchmarks/bench_program_load.py [--rounds 3]

The programs: the demo engine's prefill for every (row bucket, length bucket). A cold child
process stores both forms in a temporary cache; each round then starts two warm children,
one loading every program each way in one order and one in the other, so that neither form
gets the process's first-load costs. Writes benchmarks/results/program_load.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bench_results import machine, write_result  # noqa: E402


def _child(phase: str, root: str, order: str) -> dict:
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import numpy as np
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    from jaxrl_agent import program_store
    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.sampling.engine import SamplingEngine
    from jaxrl_agent.sampling.engine_config import agent_sampling

    model, tok = load_policy(os.path.join(os.path.dirname(program_store.__file__), "assets", "demo_policy"))
    eng = SamplingEngine(model, agent_sampling(stop_token_ids=tuple(tok.stop_ids)))
    calls = []
    for r in eng.row_buckets:
        for t in eng.buckets:
            z = np.zeros((r, t), np.int32)
            calls.append((eng.state, eng.cache, eng.logits, np.arange(r, dtype=np.int32), z, z, np.zeros(r, bool)))
    path = [os.path.join(root, f"exe{i}.pkl") for i in range(len(calls))]
    if phase == "cold":
        for a, p in zip(calls, path):
            eng._prefill_fn.program(*a)  # exports and stores it
            Path(p).write_bytes(pickle.dumps(serialize(eng._prefill_fn.jitted.lower(*a).compile())))
        return {"programs": len(calls)}

    def store():
        for a in calls:
            eng._prefill_fn.program(*a)

    def executable():
        for p in path:
            deserialize_and_load(*pickle.loads(Path(p).read_bytes()))

    out = {}
    for name, fn in ((("store", store), ("executable", executable)) if order == "store_first"
                     else (("executable", executable), ("store", store))):
        t0 = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - t0
    return {**out, "programs": len(calls)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "program_load.json"))
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as root:
        def run(phase, order=""):
            res = subprocess.run([sys.executable, __file__, "--child", phase, root, order], capture_output=True,
                                 text=True, check=True)
            return json.loads(res.stdout.strip().splitlines()[-1])

        n = run("cold")["programs"]
        for _ in range(args.rounds):
            for order in ("store_first", "executable_first"):
                r = run("warm", order)
                runs.append({"order": order, "store_s": r["store"], "executable_s": r["executable"]})
                print(f"{order}: {n} programs, store {r['store']:.2f} s, executable {r['executable']:.2f} s")
    ratios = sorted(r["store_s"] / r["executable_s"] for r in runs)
    result = {"programs": n, "runs": runs, "store_over_executable": ratios,
              "saved_ms_per_program": sorted(1e3 * (r["store_s"] - r["executable_s"]) / n for r in runs),
              "machine": machine()}
    print(f"store / executable: {ratios[0]:.2f}-{ratios[-1]:.2f}x; saved per program "
          f"{result['saved_ms_per_program'][0]:.0f}-{result['saved_ms_per_program'][-1]:.0f} ms")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")))
    else:
        main()
