"""`python -m experiments.binary_search_rl.pretrain_check [--section.field=value ...]`

The pretraining stage alone, judged by what it is for: after the copy steps and the edit
drills (`stages.pretrain`, reused from `work_dir` when cached), how much of an edit can the
drilled base copy? It runs the study's teacher-forced diagnostic (`diagnostics.teacher_forced`,
the expert's perfect episodes on held-out instances) on the drilled base and, when there were
copy steps, on the copy-only model, and prints the per-tool and per-part tables. Minutes
instead of the study's hour, so a pretraining setting can be compared before SFT and RL:

    python -m experiments.binary_search_rl.pretrain_check --pretrain.steps=250 --pretrain.num_tasks=2000 \\
        --pretrain.copy_steps=0 --work_dir=runs/pretrain_check/no_copy
    python -m experiments.binary_search_rl.pretrain_check --pretrain.steps=250 --pretrain.num_tasks=2000 \\
        --work_dir=runs/pretrain_check/copy

Writes `<work_dir>/pretrain_check.json`. The default `work_dir` is its own, so the study's
cached diagnostic is never replaced by this one's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from experiments.binary_search_rl import diagnostics, stages
from experiments.binary_search_rl.config import PRESETS
from experiments.binary_search_rl.stage_cache import stage_dir
from jaxrl_agent.cli.main import apply_overrides
from jaxrl_agent.env.sandbox import Sandbox


def check(cfg) -> dict:
    """Pretrain (cached) and diagnose the drilled base (and the copy-only model)."""
    base = stages.pretrain(cfg)
    if base is None:
        raise ValueError("--pretrain.steps=0: there is no pretraining stage to check")
    policies = {"pretrain": base["policy"]}
    copy_only = os.path.join(stage_dir(cfg, "pretrain_copy"), "policy")
    if cfg.pretrain.copy_steps > 0 and os.path.isdir(copy_only):
        policies["copy_only"] = copy_only
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        diag = diagnostics.teacher_forced(cfg, policies, sandbox)
    out = {"config": {"pretrain": asdict(cfg.pretrain), "model": asdict(cfg.model)}, "diagnostics": diag,
           "drill_nll_last_50": sum(base["nll"][-50:]) / len(base["nll"][-50:]), "seconds": base["seconds"]}
    if "copy_nll" in base:
        out["copy_nll_last_50"] = sum(base["copy_nll"][-50:]) / len(base["copy_nll"][-50:])
    with open(os.path.join(cfg.work_dir, "pretrain_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.binary_search_rl.pretrain_check",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = apply_overrides(replace(PRESETS[args.preset], work_dir="runs/pretrain_check"), overrides)
    except ValueError as e:
        parser.error(str(e))
    out = check(cfg)
    print(diagnostics.diagnostics_markdown(out["diagnostics"], {"pretrain": "drilled base",
                                                                "copy_only": "copy steps only"}))
    for name, per_tool in out["diagnostics"]["per_policy"].items():
        for part in ("lines", "old"):
            at = per_tool.get("edit_parts", {}).get(part, {}).get("first_error_at")
            if at and sum(at):
                print(f"{name}: {sum(at)} wrong {part!r} addresses, first wrong token at index 0 / 1 / 2 / later: "
                      + " / ".join(map(str, at)))
    print(f"drill nll (last 50 steps) {out['drill_nll_last_50']:.4f}"
          + (f"; copy nll (last 50 steps) {out['copy_nll_last_50']:.4f}" if "copy_nll_last_50" in out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
