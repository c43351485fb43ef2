"""Two `python -m jaxrl_agent eval` summaries of the same task file, paired by task (HOST).

    python -m experiments.binary_search_rl.paired_eval A.json B.json [C.json D.json ...]

prints, for each pair (A - B, C - D, ...), each side's pass@1 and the per-task pass-rate
difference with its bootstrap interval and sign test (`evaluation.paired_difference`). Both
summaries must come from the same tasks (the eval's `per_task`: task id -> [successes,
episodes]); a task evaluated by one side only is an error, not silently dropped.
"""
from __future__ import annotations

import json
import sys

from jaxrl_agent.agent.evaluation import paired_difference


def task_rates(path: str) -> dict[str, float]:
    with open(path) as f:
        per_task = json.load(f)["per_task"]
    return {task: successes / episodes for task, (successes, episodes) in per_task.items()}


def paired(a_path: str, b_path: str) -> dict:
    a, b = task_rates(a_path), task_rates(b_path)
    if set(a) != set(b):
        raise ValueError(f"{a_path} and {b_path} evaluated different tasks ({len(set(a) ^ set(b))} differ): "
                         "evaluate both policies on the same --eval.task_file")
    keys = sorted(a)
    return {"a_pass1": sum(a.values()) / len(a), "b_pass1": sum(b.values()) / len(b),
            **paired_difference([a[k] for k in keys], [b[k] for k in keys])}


def main(argv: list[str] | None = None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if not paths or len(paths) % 2:
        raise SystemExit("usage: python -m experiments.binary_search_rl.paired_eval A.json B.json [C.json D.json ...]")
    for a, b in zip(paths[::2], paths[1::2]):
        r = paired(a, b)
        print(f"{a} - {b}: pass@1 {r['a_pass1']:.3f} - {r['b_pass1']:.3f}, paired by task {r['mean']:+.3f} "
              f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], {r['n_pos']} better / {r['n_neg']} worse of {r['n']} "
              f"tasks, sign test p {r['sign_p']:.3f}")


if __name__ == "__main__":
    main()
