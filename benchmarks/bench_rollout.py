"""One RL iteration's agent rollout, side by side: the engine's row-subset flush, the agent's
run_tests CPU limit and the engine's row count, each against what it replaced (HOST + DEVICE).

    python benchmarks/bench_rollout.py [--tasks 6] [--group 8] [--repeats 2]

A rollout is `collect_episodes` on `--tasks` train-split tasks x `--group` episodes with the
shipped demo policy (the study's tiny SFT policy), the agent jobs' engine shape (1024 slots,
96 tokens per turn) and the study's 2 sandbox workers: sampling, tool calls and verification
all share this machine's cores, as in training. Settings, each a full rollout on the same
tasks and seeds, alternated repeat by repeat:

- `whole_batch_flush_t0.5_rows32`: the study's previous setting. Every flush prefilled all
  32 rows, padded to the longest staged chunk (the engine's former `flush`, reproduced here),
  and a looping test could burn 0.5 CPU-seconds per test;
- `row_flush_t0.5_rows32`: the engine's flush now: one prefill per length bucket, on just
  the rows that need it;
- `row_flush_t0.05_rows32`: plus a 0.05 s CPU limit per test;
- `row_flush_t0.05_rows16`: plus 16 engine rows (the study's setting now);
- `row_flush_t0.05_rows16_in_process_verify`: the same with verify's former hidden-test run
  (tests in the code's own process), so `judge_cost` = judge seconds / in-process seconds
  is what the judge process costs one RL iteration's rollout;
- `row_flush_t0.05_rows16_chunk16`: the rollout now (`RolloutConfig.decode_chunk=16`): rows
  decode 16 steps per engine call and a row whose turn ended goes to its tools at once,
  instead of every row of a turn waiting for the longest one (the settings above decode
  whole turns, `decode_chunk=0`);
- `row_flush_t0.05_rows16_chunk16_shared`: plus prompt prefixes copied from a row's cache
  (`SamplingConfig.share_prefix_min=32`: a group's 8 episodes share their prompt, all
  episodes the system prompt) instead of prefilled (the settings above: 0);
- `row_flush_t0.05_rows16_chunk16_shared_decode_rows`: the rollout now, plus decode calls on
  just the rows in a turn, gathered into a decode row bucket of 4, 8 or 16
  (`SamplingConfig.decode_row_buckets`, default) instead of on all 16 rows (the settings
  above).

Episodes differ between the two limits only where a test timed out (its message quotes the
limit). Prints seconds per rollout, where the time went and each ratio to the first setting,
and records each engine's `warmup` seconds (its compiles: more decode row buckets, more
decode loops); writes benchmarks/results/rollout.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from jaxrl_agent.agent.policy import DEMO_POLICY_DIR, load_policy
from jaxrl_agent.agent.rollout import collect_episodes
from jaxrl_agent.config import RolloutConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import generate_tasks
from jaxrl_agent.env.tools import ToolConfig
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import agent_sampling
from jaxrl_agent.tokenizer import ChatFormat

SETTINGS = {  # name: (flush, test CPU limit s, engine rows, verify's hidden-test run, decode chunk,
    #                 shared prompt prefixes, decode calls on all rows or on the rows in a turn)
    "whole_batch_flush_t0.5_rows32": ("whole_batch", 0.5, 32, "judge", 0, False, "all"),
    "row_flush_t0.5_rows32": ("rows", 0.5, 32, "judge", 0, False, "all"),
    "row_flush_t0.05_rows32": ("rows", 0.05, 32, "judge", 0, False, "all"),
    "row_flush_t0.05_rows16": ("rows", 0.05, 16, "judge", 0, False, "all"),
    "row_flush_t0.05_rows16_in_process_verify": ("rows", 0.05, 16, "in_process", 0, False, "all"),
    "row_flush_t0.05_rows16_chunk16": ("rows", 0.05, 16, "judge", 16, False, "all"),
    "row_flush_t0.05_rows16_chunk16_shared": ("rows", 0.05, 16, "judge", 16, True, "all"),
    "row_flush_t0.05_rows16_chunk16_shared_decode_rows": ("rows", 0.05, 16, "judge", 16, True, "turn"),
}


def in_process_hidden_run(task, sources, sandbox, timeout_s, test_timeout_s):
    """verify's former hidden-test run: the tests in the same process as the code under test
    (`Sandbox.run` with in-memory test sources), before the judge process existed."""
    import shutil
    import sys
    import tempfile

    from jaxrl_agent.env.verifier import pytest_args
    fresh = tempfile.mkdtemp(prefix="jxa-verify-")
    try:
        for rel, text in sources.items():
            os.makedirs(os.path.dirname(os.path.join(fresh, rel)), exist_ok=True)
            with open(os.path.join(fresh, rel), "w") as f:
                f.write(text)
        return sandbox.run(fresh, [sys.executable, "-m", "pytest", *pytest_args(sorted(task.hidden_tests))],
                           timeout_s=timeout_s, memory_files=dict(task.hidden_tests), test_timeout_s=test_timeout_s)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def whole_batch_flush(eng: SamplingEngine) -> None:
    """The engine's former `flush`: one prefill of all B rows, padded to the longest chunk."""
    lens = np.array([len(s) for s in eng._staged])
    if not lens.any():
        return
    t = next(b for b in eng.buckets if b >= lens.max())
    tokens = np.zeros((len(lens), t), np.int32)
    for b, ids in enumerate(eng._staged):
        tokens[b, : len(ids)] = ids
    valid = (np.arange(t)[None, :] < lens[:, None]).astype(np.int32)
    rows = np.arange(len(lens), dtype=np.int32)
    eng.cache, eng.logits = eng._prefill_fn(eng.state, eng.cache, eng.logits, rows, tokens, valid, eng._reset.copy())
    eng.tokens_prefilled += int(lens.sum())
    eng.tokens_prefill_padded += int((lens > 0).sum()) * t
    eng._staged = [[] for _ in lens]
    eng._reset[:] = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout.json"))
    args = ap.parse_args()
    settings = {k: SETTINGS[k] for k in args.settings}
    model, tok = load_policy(DEMO_POLICY_DIR)
    chat = ChatFormat(tok, tool_style="short")
    tasks = generate_tasks("train", args.tasks, 123)
    rollout = RolloutConfig(group_size=args.group)
    engines = {}
    for name, (flush, _, rows, _, _, shared, decode) in settings.items():
        eng = SamplingEngine(model, agent_sampling(batch_size=rows, stop_token_ids=tuple(tok.stop_ids), seed=0,
                                                   share_prefix_min=32 if shared else 0,
                                                   decode_row_buckets=(rows,) if decode == "all" else ()))
        if flush == "whole_batch":
            eng.flush = (lambda e: lambda: whole_batch_flush(e))(eng)
        engines[name] = eng
    seconds = {name: [] for name in settings}
    parts = {name: [] for name in settings}
    from jaxrl_agent.env import verifier
    judged_run = verifier._run_hidden

    def use_verify(name):
        verifier._run_hidden = in_process_hidden_run if settings[name][3] == "in_process" else judged_run

    with Sandbox(num_workers=2) as sandbox:
        warmup_s = {}
        for name, eng in engines.items():  # compile every shape and warm the sandbox once
            t0 = time.perf_counter()
            eng.warmup()  # compiles: each engine has its own jitted functions (no shared cache)
            warmup_s[name] = time.perf_counter() - t0
            use_verify(name)
            collect_episodes(tasks[:1], eng, chat, sandbox, replace(rollout, group_size=2, decode_chunk=settings[name][4]),
                             ToolConfig(test_timeout_s=settings[name][1]), seed=1)
        for rep in range(args.repeats):
            names = list(settings) if rep % 2 == 0 else list(settings)[::-1]
            for name in names:
                use_verify(name)
                eng = engines[name]
                t0, steps0, prefilled0 = time.perf_counter(), eng.decode_steps, eng.tokens_prefilled
                row_steps0 = eng.decode_row_steps
                eps, stats = collect_episodes(tasks, engines[name], chat, sandbox,
                                              replace(rollout, decode_chunk=settings[name][4]),
                                              ToolConfig(test_timeout_s=settings[name][1]), seed=7)
                seconds[name].append(time.perf_counter() - t0)
                parts[name].append({"sampling_s": stats.seconds_sampling, "tools_s_summed": stats.seconds_tools,
                                    "verify_s_summed": stats.seconds_verify, "tokens_sampled": stats.tokens_sampled,
                                    "decode_steps": engines[name].decode_steps - steps0,
                                    "decode_row_steps": engines[name].decode_row_steps - row_steps0,
                                    "tokens_prefilled": engines[name].tokens_prefilled - prefilled0, "engine_calls": stats.engine_calls,
                                    "success": float(np.mean([e.reward for e in eps]))})
    verifier._run_hidden = judged_run
    med = {k: float(np.median(v)) for k, v in seconds.items()}
    base = med[next(iter(settings))]
    study, former = "row_flush_t0.05_rows16", "row_flush_t0.05_rows16_in_process_verify"
    result = {
        "median_seconds": med, "all_seconds": seconds, "ratio_to_previous_setting": {k: base / v for k, v in med.items()},
        "speedup_study_setting_vs_previous": base / med[study] if study in med else None,
        "judge_cost": med[study] / med[former] if study in med and former in med else None, "parts": parts,
        "engine_warmup_s": warmup_s,
        "setup": {"tasks": args.tasks, "group": args.group, "repeats": args.repeats, "episodes": args.tasks * args.group,
                  "policy": "jaxrl_agent/assets/demo_policy", "sandbox_workers": 2},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__},
    }
    print(f"rollout of {args.tasks} tasks x {args.group} episodes (demo policy, 2 sandbox workers)")
    print(f"{'setting':34s} {'median s':>9s} {'speedup':>8s} {'sampling s':>11s} {'success':>8s}")
    for name in settings:
        p = parts[name][-1]
        print(f"{name:34s} {med[name]:9.1f} {base / med[name]:8.2f} {p['sampling_s']:11.1f} {p['success']:8.2f}")
    if result["judge_cost"] is not None:
        print(f"judge cost: {result['judge_cost']:.3f}x the rollout with in-process verify")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
