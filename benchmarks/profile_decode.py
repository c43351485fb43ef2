"""Where a decode step's time goes: a JAX profiler trace of the sampling benchmark's decode loop.

    python benchmarks/profile_decode.py [--batch 16] [--prompt 128] [--new 256]

Same model and setting as bench_sampling.py (tiny random Qwen2, temperature 1). One warm turn
is timed, then one is traced; the trace's XLA:CPU kernel runs are counted per decode step and
grouped by kind (matmuls, transposes, copies, ...). Prints a table and writes
benchmarks/results/decode_profile.json. This explains the sampler's figure; it is not itself
a comparison.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from bench_sampling import VOCAB, make_checkpoint, ours_generate

from jaxrl_agent.config import SamplingConfig
from jaxrl_agent.hf import load_pretrained
from jaxrl_agent.sampling.engine import SamplingEngine

_HOST_EVENTS = ("$", "Thunk", "np.", "Slinky", "Pjit", "end:")  # Python frames and runtime bookkeeping
MATMUL = "weight matmuls (projections, MLP, unembedding)"  # a role of library_kernel_role


def kernel_events(trace_dir: str) -> list[dict]:
    """Every XLA kernel run in the trace under `trace_dir`: its trace event (name, ts, dur, tid)."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("name") and not e["name"].startswith(_HOST_EVENTS)]


def kernel_runs(trace_dir: str, full_names: bool = False) -> list[tuple[str, float]]:
    """(kernel kind, microseconds) of every XLA kernel run in the trace under `trace_dir`;
    with `full_names` the instruction name (e.g. "ynn_fusion.95") instead of its kind."""
    return [(e["name"] if full_names else re.sub(r"[.\d]+$", "", e["name"]), float(e.get("dur", 0.0)))
            for e in kernel_events(trace_dir)]


def overlap(trace_dir: str, names: dict[str, str], role: str = MATMUL) -> dict[str, float]:
    """How much of the `role` kernels' traced time another kernel ran beside them.

    XLA:CPU runs independent kernels at once (q, k and v projections, gate and up), one per
    thread, so a traced run that shares the two cores lasts longer than the kernel alone would:
    its duration is not the kernel's own cost. Returns the runs' mean microseconds, the share
    of their time some kernel on another thread overlapped, and the mean of the runs with
    under 5% overlap ("alone") and of the others ("beside another")."""
    events = sorted((e for e in kernel_events(trace_dir) if not e["name"].startswith("while")),
                    key=lambda e: e["ts"])
    starts = np.array([e["ts"] for e in events])
    longest = max((e["dur"] for e in events), default=0.0)
    durs, shared = [], []
    for e in events:
        if not (e["name"].startswith("ynn_fusion") and library_kernel_role(names.get(e["name"], "")) == role):
            continue
        a, b, o = e["ts"], e["ts"] + e["dur"], 0.0
        for f in events[np.searchsorted(starts, a - longest):]:
            if f["ts"] > b:
                break
            if f["tid"] != e["tid"]:
                o += max(0.0, min(b, f["ts"] + f["dur"]) - max(a, f["ts"]))
        durs.append(e["dur"])
        shared.append(min(1.0, o / max(e["dur"], 1e-9)))
    d, sh = np.array(durs, float), np.array(shared, float)
    alone = sh < 0.05
    return {"runs": len(d), "mean_us": float(d.mean()), "overlapped_share": float((sh * d).sum() / d.sum()),
            "alone_runs": int(alone.sum()), "alone_mean_us": float(d[alone].mean()) if alone.any() else float("nan"),
            "beside_another_mean_us": float(d[~alone].mean()) if (~alone).any() else float("nan")}


def occupancy(trace_dir: str) -> dict[str, float]:
    """Microseconds of the traced span (first kernel start to last kernel end) during which no
    kernel ran ("idle": the runtime between kernels), exactly one, and two or more at once
    (loop and conditional containers left out: they span their bodies)."""
    edges = []
    for e in kernel_events(trace_dir):
        if not e["name"].startswith(("while", "conditional")):
            edges += [(e["ts"], 1), (e["ts"] + e["dur"], -1)]
    edges.sort()
    spent = {0: 0.0, 1: 0.0, 2: 0.0}
    level, last = 0, edges[0][0]
    for t, step in edges:
        spent[min(level, 2)] += t - last
        level, last = level + step, t
    return {"span_us": edges[-1][0] - edges[0][0], "idle_us": spent[0], "one_kernel_us": spent[1],
            "two_or_more_us": spent[2]}


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the JAX operation it came from (`op_name` metadata, last part)."""
    out = {}
    for m in re.finditer(r"^\s*%?([\w.-]+) = .*?op_name=\"([^\"]+)\"", hlo_text, re.M):
        parts = m.group(2).split("/")
        out[m.group(1)] = "/".join(parts[-2:]) if parts[-1] == "dot_general" else parts[-1]
    return out


def library_kernel_role(op: str) -> str:
    """What a YNNPACK kernel (matmul or reduction) does in the decode step, from its op name."""
    if op.startswith(("bkqd,bkds->bkqs", "bkqd,bksd->bkqs")):  # keys as cached [Dh, S], or [S, Dh]
        return "attention scores (q . k over the window)"
    if op.startswith("bkqs,bksd->bkqd"):
        return "attention values (p . v over the window)"
    if op.endswith("dot_general"):
        return MATMUL
    if op.startswith("reduce"):
        return "reductions (RMSNorm, softmax, sampling)"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_profile.json"))
    args = ap.parse_args()
    B, P, N = args.batch, args.prompt, args.new
    tmp = tempfile.mkdtemp()
    make_checkpoint(tmp)
    model, _ = load_pretrained(tmp)
    eng = SamplingEngine(model, SamplingConfig(temperature=1.0, max_new_tokens=N, batch_size=B, cache_size=P + N,
                                               prefill_buckets=(P,), seed=0))
    prompts = np.random.default_rng(0).integers(0, VOCAB, (B, P))
    eng.warmup()
    ours_generate(eng, prompts, 0)
    t0 = time.perf_counter()
    ours_generate(eng, prompts, 1)
    step_ms = 1000 * (time.perf_counter() - t0) / N
    # the compiled program, to name the traced kernels (compiled once more, not timed)
    generate_fn, hlo = eng._generate_fn, {}

    def spy(*a):
        if not hlo:
            hlo["text"] = generate_fn.lower(*a).compile().as_text()
        return generate_fn(*a)

    eng._generate_fn = spy
    ours_generate(eng, prompts, 1)
    eng._generate_fn = generate_fn
    names = op_names(hlo["text"])
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    ours_generate(eng, prompts, 2)
    jax.profiler.stop_trace()
    runs = kernel_runs(trace_dir, full_names=True)
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    by_library: dict[str, list[float]] = collections.defaultdict(list)
    for name, us in runs:
        by_kind[re.sub(r"[.\d]+$", "", name)].append(us)
        if name.startswith("ynn_fusion"):
            by_library[library_kernel_role(names.get(name, ""))].append(us)
    total = sum(us for _, us in runs)
    result = {
        "ms_per_decode_step": step_ms, "kernel_runs_per_step": len(runs) / N,
        "mean_kernel_us": total / max(1, len(runs)),
        "by_kind": {k: {"share": sum(v) / total, "runs_per_step": len(v) / N}
                    for k, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))},
        "ynn_fusion_by_role": {k: {"share": sum(v) / total, "runs_per_step": len(v) / N,
                                   "mean_us": sum(v) / max(1, len(v))} for k, v in sorted(by_library.items())},
        "weight_matmul_overlap": overlap(trace_dir, names),
        "occupancy_us_per_step": {k: v / N for k, v in occupancy(trace_dir).items()},
        "setup": {"batch": B, "prompt": P, "new_tokens": N, "jax": jax.__version__},
    }
    print(f"decode step: {step_ms:.2f} ms (untraced), {result['kernel_runs_per_step']:.0f} kernel runs per step, "
          f"{result['mean_kernel_us']:.1f} us each on average (traced)")
    print(f"{'kernel kind':28s} {'share':>7s} {'runs/step':>10s}")
    for kind, row in list(result["by_kind"].items())[:12]:
        print(f"{kind:28s} {100 * row['share']:6.1f}% {row['runs_per_step']:10.1f}")
    print(f"{'ynn_fusion kernels by role':48s} {'share':>7s} {'runs/step':>10s} {'us/run':>8s}")
    for role, row in result["ynn_fusion_by_role"].items():
        print(f"{role:48s} {100 * row['share']:6.1f}% {row['runs_per_step']:10.1f} {row['mean_us']:8.1f}")
    ov, occ = result["weight_matmul_overlap"], result["occupancy_us_per_step"]
    print(f"weight matmuls: {ov['mean_us']:.1f} us a run, {100 * ov['overlapped_share']:.0f}% of their time beside "
          f"another kernel; alone {ov['alone_mean_us']:.1f} us ({ov['alone_runs']} runs), beside another "
          f"{ov['beside_another_mean_us']:.1f} us")
    print(f"per step (traced turn, prefill included): {occ['span_us']:.0f} us, no kernel running "
          f"{occ['idle_us']:.0f}, one {occ['one_kernel_us']:.0f}, two or more {occ['two_or_more_us']:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
