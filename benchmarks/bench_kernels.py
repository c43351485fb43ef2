"""GAE side by side: jitted scan, jitted associative scan, NumPy loop, PyTorch loop, and the
memory-bound floor, all in one process on the same masked inputs.

    python benchmarks/bench_kernels.py [--B 64] [--T 4096] [--repeats 50]

Prints a table and writes benchmarks/results/kernels.json. Every implementation is checked
against the jitted scan before it is timed, so a fast wrong kernel cannot win.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxrl_agent import advantages as A

GAMMA, LAM = 0.99, 0.95


# ---- the alternatives a user would otherwise write ----
def gae_numpy_loop(r, v, m, gamma=GAMMA, lam=LAM):
    """Reverse loop over t, vectorised over B (NumPy)."""
    B, T = r.shape
    adv = np.zeros_like(r)
    next_v = np.zeros(B, r.dtype)
    run = np.zeros(B, r.dtype)
    for t in reversed(range(T)):
        pol = m[:, t] > 0
        run = np.where(pol, r[:, t] + gamma * next_v - v[:, t] + gamma * lam * run, run)
        next_v = np.where(pol, v[:, t], next_v)
        adv[:, t] = np.where(pol, run, 0.0)
    return adv, adv + v * m


def gae_torch_loop(r, v, m, gamma=GAMMA, lam=LAM):
    """The PyTorch RL-library pattern: a Python reverse loop over t, a list of columns,
    torch.stack at the end (as in TRL/OpenRLHF), with the same observation-skipping mask."""
    B, T = r.shape
    next_v = torch.zeros(B)
    run = torch.zeros(B)
    cols = []
    for t in reversed(range(T)):
        pol = m[:, t] > 0
        run = torch.where(pol, r[:, t] + gamma * next_v - v[:, t] + gamma * lam * run, run)
        next_v = torch.where(pol, v[:, t], next_v)
        cols.append(torch.where(pol, run, 0.0))
    adv = torch.stack(cols[::-1], dim=1)
    return adv, adv + v * m


def floor(r, v, m):
    """One fused elementwise pass reading r, v, m and writing two [B, T] arrays."""
    adv = (r - v) * m
    return adv, adv + v * m


# ---- timing ----
def time_interleaved(fns: dict, args: dict, repeats: int, sync) -> dict:
    """Median seconds per call, alternating the implementations call by call so that any
    background load on the machine hits all of them alike."""
    for name, fn in fns.items():
        sync(fn(*args[name]))  # warm-up / compile
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            sync(fn(*args[name]))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--slow-repeats", type=int, default=3, help="repeats for the Python loops")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels.json"))
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    B, T = args.B, args.T
    r = rng.normal(size=(B, T)).astype(np.float32)
    v = rng.normal(size=(B, T)).astype(np.float32)
    m = (rng.uniform(size=(B, T)) < 0.7).astype(np.float32)  # observation spans scattered
    rj, vj, mj = map(jnp.asarray, (r, v, m))
    rt, vt, mt = map(torch.from_numpy, (r, v, m))
    block = jax.block_until_ready

    scan = jax.jit(lambda r, v, m: A.gae(r, v, m, gamma=GAMMA, lam=LAM, method="scan"))
    assoc = jax.jit(lambda r, v, m: A.gae(r, v, m, gamma=GAMMA, lam=LAM, method="associative"))
    floor_j = jax.jit(floor)

    # ---- correctness first ----
    want = np.asarray(scan(rj, vj, mj)[0])
    np.testing.assert_allclose(np.asarray(assoc(rj, vj, mj)[0]), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gae_numpy_loop(r, v, m)[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gae_torch_loop(rt, vt, mt)[0].numpy(), want, rtol=1e-4, atol=1e-4)

    # ---- timings (median seconds) ----
    fast = {
        "jax lax.scan (time-major, fused)": scan,
        "jax associative_scan": assoc,
        "floor: fused elementwise pass": floor_j,
    }
    rows = time_interleaved(fast, {k: (rj, vj, mj) for k in fast}, args.repeats, block)
    slow = {"numpy reverse loop": gae_numpy_loop, "torch reverse loop": gae_torch_loop}
    slow_args = {"numpy reverse loop": (r, v, m), "torch reverse loop": (rt, vt, mt)}
    rows.update(time_interleaved(slow, slow_args, args.slow_repeats, lambda x: x))
    best_jax = min(rows["jax lax.scan (time-major, fused)"], rows["jax associative_scan"])
    fl = rows["floor: fused elementwise pass"]
    result = {
        "B": B, "T": T, "gamma": GAMMA, "lam": LAM,
        "median_seconds": rows,
        "gae_speedup_vs_torch_loop": rows["torch reverse loop"] / best_jax,
        "gae_speedup_vs_numpy_loop": rows["numpy reverse loop"] / best_jax,
        "gae_ratio_to_floor": best_jax / fl,
        "associative_over_scan": rows["jax associative_scan"] / rows["jax lax.scan (time-major, fused)"],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "torch": torch.__version__},
    }

    print(f"GAE, B={B}, T={T}, float32, ~30% observation tokens")
    print(f"{'implementation':38s} {'median ms':>10s} {'x floor':>8s}")
    for name, sec in rows.items():
        print(f"{name:38s} {sec * 1e3:10.3f} {sec / fl:8.1f}")
    print(f"faster jitted GAE vs torch loop: {result['gae_speedup_vs_torch_loop']:.0f}x; "
          f"vs numpy loop: {result['gae_speedup_vs_numpy_loop']:.0f}x; "
          f"ratio to floor: {result['gae_ratio_to_floor']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
