"""`python -m experiments.binary_search_rl.ablate --name=NAME [--control=true] [--section.field=value ...]`

One RL setting tried against its own shuffled-reward control, from the study's SFT policy
(stages 1-2 are reused from `work_dir` when cached, built otherwise; `--sft_from=DIR` starts
from a given one, e.g. the shipped `results/policies/sft`), judged on training data
only: success and behaviour of every iteration's training rollouts, and pass@1 on fresh
instances of the *training* templates before and after (a validation set; the held-out sets
are never read, so a setting chosen here is not tuned on them).

    python -m experiments.binary_search_rl.ablate --name=agg_seq --rl.agg=seq-mean-token-mean
    python -m experiments.binary_search_rl.ablate --name=shaping --rl.tool_error_penalty=-0.2

Both runs of a setting see the same tasks in the same order (the task iterator and the
sampling seeds depend only on `seed`), so the comparison is paired iteration by iteration.
Writes `<work_dir>/ablations/NAME/ablation.json` and its copy `<results_dir>/ablations/NAME.json`,
and prints a table. `--summarize=true` (no `--name`) prints one table of every ablation in
`<results_dir>/ablations`.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys

from experiments.binary_search_rl import stages
from experiments.binary_search_rl.__main__ import given_sft
from experiments.binary_search_rl.config import PRESETS, StudyConfig
from jaxrl_agent.cli.main import apply_overrides

SERIES = ("success", "tool_errors", "interface_errors", "submitted", "edits", "tokens")


def run_ablation(cfg: StudyConfig, name: str, *, control: bool = True) -> dict:
    """RL with `cfg.rl` (and, with `control`, the same run on shuffled rewards) from the SFT policy."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"--name must be a plain directory name, got {name!r}")
    start = (given_sft(cfg.sft_from) if cfg.sft_from
             else stages.sft_policies(cfg, success_only=False, jobs=cfg.jobs)["sft"])
    out_dir = os.path.join(cfg.work_dir, "ablations", name)
    sub = dataclasses.replace(cfg, work_dir=out_dir)
    runs = {}
    for run, shuffle in (("rl", False), ("control", True))[: 2 if control else 1]:
        res = stages.rl(sub, run, start, shuffle_rewards=shuffle)
        if res["policy"] is None:
            raise RuntimeError(f"[{name}/{run}] RL did not start: {res['no_signal']}")
        runs[run] = {"series": {k: [it.get(k) for it in res["train_reward"]] for k in SERIES},
                     "validation_pass1": {"before": res["validation_curve"][0]["validation_pass1"],
                                          "after": res["validation_curve"][-1]["validation_pass1"]},
                     "seconds": res["seconds"]}
    result = {"name": name, "rl": dataclasses.asdict(cfg.rl), "seed": cfg.seed, "runs": runs,
              "validation": {"split": "train", "seed": cfg.seed + stages.VALIDATION_SEED_OFFSET, "tasks": cfg.rl.curve_tasks}}
    os.makedirs(os.path.join(cfg.results_dir, "ablations"), exist_ok=True)
    for path in (os.path.join(out_dir, "ablation.json"), os.path.join(cfg.results_dir, "ablations", f"{name}.json")):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(ablation_table(result))
    return result


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / max(len(xs), 1)


def _thirds(xs) -> tuple[float, float]:
    """Means over the first and the last third of the iterations."""
    third = max(len(xs) // 3, 1)
    return _mean(xs[:third]), _mean(xs[-third:])


def ablation_table(result: dict) -> str:
    """Markdown: each series' mean over all iterations and over the first / last third."""
    lines = [f"ablation {result['name']}", "| run | series | all | first third | last third |", "|---|---|---|---|---|"]
    for run, r in result["runs"].items():
        for k in SERIES:
            first, last = _thirds(r["series"][k])
            lines.append(f"| {run} | {k} | {_mean(r['series'][k]):.3f} | {first:.3f} | {last:.3f} |")
        v = r["validation_pass1"]
        lines.append(f"| {run} | validation pass@1 | | {v['before']:.3f} (before) | {v['after']:.3f} (after) |")
    return "\n".join(lines)


def summary_table(results_dir: str) -> str:
    """Markdown: every saved ablation, one row per run, first-third -> last-third means."""
    paths = sorted(glob.glob(os.path.join(results_dir, "ablations", "*.json")))
    if not paths:
        raise FileNotFoundError(f"no ablations in {os.path.join(results_dir, 'ablations')}: run one with --name first")
    lines = ["| ablation | run | success | tool errors / ep | submitted | edits / ep | validation pass@1 |",
             "|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for run, r in result["runs"].items():
            cells = ["{:.2f} -> {:.2f}".format(*_thirds(r["series"][k]))
                     for k in ("success", "tool_errors", "submitted", "edits")]
            v = r["validation_pass1"]
            lines.append(f"| {result['name']} | {run} | " + " | ".join(cells) + f" | {v['before']:.2f} -> {v['after']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.binary_search_rl.ablate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="", help="directory under <work_dir>/ablations")
    parser.add_argument("--control", default="true", choices=("true", "false"))
    parser.add_argument("--summarize", default="false", choices=("true", "false"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = apply_overrides(PRESETS[args.preset], overrides)
    except ValueError as e:
        parser.error(str(e))
    if args.summarize == "true":
        print(summary_table(cfg.results_dir))
        return 0
    if not args.name:
        parser.error("--name is required (or --summarize=true)")
    run_ablation(cfg, args.name, control=args.control == "true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
