"""`python -m experiments.binary_search_rl [--preset=cpu|gpu] [--section.field=value ...]`

Runs the whole study (see README.md here): edit drills (pretraining) and demonstrations -> SFT (all demos) and SFT
(successful demos only) -> the gate (the SFT policy's failure layers on validation instances:
RL starts only if most failures are decisions) -> GRPO from SFT and the shuffled-reward control,
one run per seed, and one more estimator (RLOO) -> evaluation of every policy on the canonical
task, held-out instances (pass@1..8 for SFT and GRPO) and held-out templates, and their
teacher-forced next-action accuracy on held-out expert episodes -> summary.json,
plots and rendered trajectories in `results_dir`. Finished stages are reused from `work_dir`
when their config is unchanged, so an interrupted study continues where it stopped.
`--ship_demo_policy=true` also copies the SFT policy to jaxrl_agent/assets/demo_policy.
`--sft_from=DIR` starts the gate and RL from a given SFT policy (the shipped one) instead.
`--jobs=N` (default 2) runs independent stages N at a time in worker processes (`parallel.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import time

from experiments.binary_search_rl import diagnostics, report, stages
from experiments.binary_search_rl.config import PRESETS, StudyConfig
from experiments.binary_search_rl.parallel import run_stages
from jaxrl_agent.cli.compile_cache import enable as enable_compile_cache
from jaxrl_agent.cli.main import apply_overrides
from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
from jaxrl_agent.tokenizer import load_tokenizer


def ship_policies(done: dict, policies_dir: str) -> list[str]:
    """The final SFT policy and the first-seed RL policy as HF directories (weights, config,
    tokenizer) in `<policies_dir>/{sft,rl}`: `python -m jaxrl_agent eval --policy.path=...`
    runs them on anyone's tasks. A policy already at its destination (`sft_from`) stays."""
    out = []
    for name in ("sft", "rl"):
        if name in done and done[name].get("policy"):
            dst = os.path.join(policies_dir, name)
            if os.path.realpath(dst) == os.path.realpath(done[name]["policy"]):
                continue
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(done[name]["policy"], dst)
            out.append(dst)
    return out


def given_sft(path: str) -> dict:
    """The stage result of an SFT policy made elsewhere (`cfg.sft_from`), checked before any
    RL run is spent on it."""
    missing = [f for f in ("config.json", "model.safetensors") if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"sft_from={path!r} is not an HF policy directory (no {', '.join(missing)}): pass the "
                         "directory a study or `python -m jaxrl_agent sft` exported, e.g. "
                         "experiments/binary_search_rl/results/policies/sft, or leave sft_from empty to train one")
    return {"policy": path, "given": True, "seconds": 0.0}


def run_study(cfg: StudyConfig, *, ship_demo_policy: bool = False, policies_dir: str | None = None) -> dict:
    if ship_demo_policy and cfg.sft_from:  # its made_by line describes the stages that made it
        raise ValueError("--ship_demo_policy=true needs the SFT stage of this run: drop --sft_from, or copy the "
                         "given policy to jaxrl_agent/assets/demo_policy by hand with its own description")
    t0 = time.time()
    done = {"sft": given_sft(cfg.sft_from)} if cfg.sft_from else stages.sft_policies(cfg, success_only=False,
                                                                                      jobs=cfg.jobs)
    runs = report.run_names(cfg.rl.seeds, cfg.rl.second_algo)
    # the gate's verdict comes first
    with Sandbox(num_workers=cfg.sandbox_workers, memo_entries=MEMO_ENTRIES) as sandbox:
        done["gate"] = stages.gate(cfg, done["sft"], sandbox)
    # the success-only baseline (the longest stage, so first), the RL runs and the evaluations,
    # `cfg.jobs` at a time; each policy's evaluation is queued the moment it exists, so the
    # evaluations fill the workers the last runs leave idle
    def evaluation(pol: str, result: dict) -> list:
        if result["policy"] is None:  # did not start (no signal): the summary says why
            return []
        return [(f"eval_{pol}", stages.evaluate_alone, (cfg, pol, result["policy"]),
                 {"passk": pol == "sft" or report.is_main_run(pol, runs, cfg.rl.algo)})]

    calls = [] if cfg.sft_from else [("sft_success_only", stages.success_only_sft, (cfg,), {})]
    if done["gate"]["rl_starts"]:
        calls += [(name, stages.rl, (cfg, name, done["sft"]), {"shuffle_rewards": shuffle, "algo": algo, "seed": seed})
                  for name, (algo, seed, shuffle) in runs.items()]
    then = {name: functools.partial(evaluation, name) for name, *_ in calls}
    pool = run_stages(cfg.jobs, calls + evaluation("sft", done["sft"]), then)
    done |= {name: pool[name] for name, *_ in calls}
    policies = [p for p in ("sft", "sft_success_only", *runs) if f"eval_{p}" in pool]
    evals = {pol: pool[f"eval_{pol}"] for pol in policies}
    with Sandbox(num_workers=cfg.sandbox_workers, memo_entries=MEMO_ENTRIES) as sandbox:
        diagnosed = {pol: done[pol]["policy"] for pol in ("pretrain", *policies) if pol in done}
        diag = diagnostics.teacher_forced(cfg, diagnosed, sandbox)
    summary = report.build_summary(dataclasses.asdict(cfg), done, evals, runs)
    summary["diagnostics"] = diag
    summary["seconds"]["diagnose"] = round(diag["seconds"], 1)
    summary["seconds"]["total_this_invocation"] = round(time.time() - t0, 1)
    written = report.write_all(summary, evals, load_tokenizer(), cfg.results_dir)
    written += ship_policies(done, policies_dir or os.path.join(cfg.results_dir, "policies"))
    print(report.results_markdown(summary))
    print("wrote", ", ".join(written))
    if ship_demo_policy:
        from jaxrl_agent.agent.policy import DEMO_POLICY_DIR

        shutil.copytree(done["sft"]["policy"], DEMO_POLICY_DIR, dirs_exist_ok=True)
        m = cfg.model  # the description is written from the config, so it cannot go stale
        made_by = (f"python -m experiments.binary_search_rl (stage 'sft': {cfg.pretrain.copy_steps} copy steps, "
                   f"{cfg.pretrain.steps} edit-drill steps on "
                   f"{cfg.pretrain.num_tasks} instances, then {cfg.sft.steps} SFT steps on {cfg.demos.num_tasks} "
                   "expert demonstrations)")
        with open(os.path.join(DEMO_POLICY_DIR, "sft_summary.json"), "w") as f:
            json.dump({"made_by": made_by,
                       "model": f"Qwen2-style, hidden {m.hidden_size}, {m.num_layers} layers",
                       "heldout_instances_pass1": "see experiments/binary_search_rl/results/summary.json "
                                                  "(heldout_instances.sft)"}, f, indent=2)
        print(f"shipped the SFT policy to {DEMO_POLICY_DIR}")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.binary_search_rl",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--ship_demo_policy", default="false", choices=("true", "false"))
    parser.add_argument("--policies_dir", default=None, metavar="DIR",
                        help="where the final SFT and RL policies are shipped (default: <results_dir>/policies)")
    parser.add_argument("--compile_cache", default=None, metavar="DIR|off",
                        help="JAX's persistent compilation cache (default: a user cache directory)")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = apply_overrides(PRESETS[args.preset], overrides)
    except ValueError as e:
        parser.error(str(e))
    print("config:", json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str), flush=True)
    enable_compile_cache(args.compile_cache)  # every stage's compiles, and a rerun's, from disk
    run_study(cfg, ship_demo_policy=args.ship_demo_policy == "true", policies_dir=args.policies_dir)
    return 0


if __name__ == "__main__":
    reexec_with_tcmalloc()  # XLA:CPU's per-call scratch: see jaxrl_agent/cli/malloc_env.py
    sys.exit(main())
