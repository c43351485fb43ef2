"""Where a policy's failed episodes leave their bugs: per bug site, on validation instances (HOST).

Pass rates and failure layers say how often a policy fails and in which layer, not which bug it
leaves or why. Here each policy samples episodes on the study's validation instances (fresh
instances of the training templates, never a held-out set), and `evaluation.bug_outcomes`
reads each injected bug from the final source: fixed, left as injected, or changed some other
way; lines written where no bug was mark a wrong place chosen. Per site (template and bug site
index, shown with the line it should read) this separates a fix the policy does not know (the
site changed wrongly) from a bug it did not find (left as injected, a correct line rewritten
instead) and from one it stopped before (left as injected, nothing written elsewhere).

    policies --sampler--> episodes on validation_tasks(cfg, tasks) x samples
             --summarize_episodes--> bug_sites {per_site, failed_with}, per_task --> markdown tables
                                     (each policy paired by task with the first one)

A measurement; what it shows chooses nothing unless measured again on validation.
`python -m experiments.binary_search_rl.sites sft=DIR rl=DIR [--tasks=64 --samples=4]`.
"""
from __future__ import annotations

import json
import sys

from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.stages import rollout_config, sampler, tools_config, validation_tasks
from jaxrl_agent.agent.evaluation import FAILED_SITE_KINDS, paired_difference
from jaxrl_agent.env.tasks import TEMPLATES
from jaxrl_agent.loops.evaluate import evaluate


def site_line(site: str) -> str:
    """The line a site should read, from its template (`"<template>/<index>"`); the site itself
    when the template is not one of ours."""
    name, _, index = site.rpartition("/")
    tpl = TEMPLATES.get(name)
    if tpl is None or not index.isdigit() or int(index) >= len(tpl.bugs):
        return site
    line = " ↵ ".join(part.strip() for part in tpl.bugs[int(index)][0].strip("\n").split("\n"))
    return f"{name}: `{line}`"


def site_outcomes(cfg: StudyConfig, policies: dict[str, str], sandbox, tasks: int, samples: int) -> dict:
    """name -> {"pass1", "bug_sites"} of each policy's sampled episodes on `tasks` validation
    instances x `samples` (the gate's instances and seed when they are the gate's numbers)."""
    out = {}
    for name, path in policies.items():
        engine, chat = sampler(cfg, path, cfg.seed)
        summary, _ = evaluate(validation_tasks(cfg, tasks), engine, chat, sandbox, rollout_config(cfg),
                              tools_config(cfg), samples, seed=cfg.seed, show_progress=False)
        out[name] = {"pass1": summary["pass1"], "failure_layers": summary["behaviour"]["failure_layers"],
                     "bug_sites": summary.get("bug_sites", {}), "per_task": summary["per_task"]}
        print(f"[sites] {name}: validation pass@1 {summary['pass1']:.3f}", flush=True)
    return out


def sites_markdown(result: dict) -> str:
    """Two tables: each site's bugs fixed / left as injected / changed per policy, and
    `failed_rows`."""
    names = list(result)
    sites = sorted({s for r in result.values() for s in r["bug_sites"].get("per_site", {})})
    rows = ["| bug site (the line it should read) | " + " | ".join(
        f"{n}: fixed / left / changed (bugs)" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for site in sites:
        cells = []
        for n in names:
            c = result[n]["bug_sites"].get("per_site", {}).get(site)
            cells.append(f"{c['fixed']:.2f} / {c['untouched']:.2f} / {c['changed']:.2f} ({c['bugs']})" if c else "-")
        rows.append(f"| {site_line(site)} | " + " | ".join(cells) + " |")
    rows += [""] + failed_rows([(f"{n} (pass@1 {result[n]['pass1']:.3f})", result[n]["bug_sites"]) for n in names])
    return "\n".join(rows) + "\n"


def paired_rows(result: dict) -> list[str]:
    """Each policy's per-task pass rate minus the first policy's on the same instances, with
    the bootstrap interval and sign test (`evaluation.paired_difference`); [] for one policy.
    Pairing removes the instances' difficulty, which dominates the unpaired intervals."""
    names = list(result)
    if len(names) < 2:
        return []
    base = names[0]
    rates = {n: {t: s / k for t, (s, k) in result[n]["per_task"].items()} for n in names}
    rows = [f"| policy | pass@1 | minus {base}, paired by task [95% interval] (sign test p) |", "|---|---|---|",
            f"| {base} | {result[base]['pass1']:.3f} | - |"]
    for n in names[1:]:
        if set(rates[n]) != set(rates[base]):
            raise ValueError(f"{n} and {base} were sampled on different tasks: run them in one sites.py call")
        keys = sorted(rates[base])
        d = paired_difference([rates[n][k] for k in keys], [rates[base][k] for k in keys])
        rows.append(f"| {n} | {result[n]['pass1']:.3f} | {d['mean']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] "
                    f"(p {d['sign_p']:.3f}, {d['n']} tasks) |")
    return rows


_HEADS = {"site_changed_wrongly": "a site changed wrongly", "line_elsewhere_rewritten": "a correct line rewritten",
          "site_left_as_injected": "a site left as injected", "every_site_fixed": "every site fixed"}


def failed_rows(entries: list[tuple[str, dict]], what: str = "failed episodes") -> list[str]:
    """The table of (row label, `summarize_episodes`' "bug_sites") entries: each one's failed
    episodes by what their sites show, with the share of them that never submitted."""
    rows = [f"| {what}: what their sites show (of them not submitted) | failed | "
            + " | ".join(_HEADS[k] for k in FAILED_SITE_KINDS) + " |", "|---" * (len(FAILED_SITE_KINDS) + 2) + "|"]
    for name, b in entries:
        cells = [f"{b.get('failed_with', {}).get(k, 0.0):.2f} ({b.get('failed_not_submitted', {}).get(k, 0.0):.2f})"
                 for k in FAILED_SITE_KINDS]
        rows.append(f"| {name} | {b.get('failed_episodes', 0)} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.binary_search_rl.sites NAME=POLICY_DIR ...`: per bug site, what
    each policy's sampled validation episodes leave; `--json=PATH` keeps the numbers."""
    import argparse

    from jaxrl_agent.env.sandbox import Sandbox

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("policies", nargs="+", help="name=policy_dir")
    p.add_argument("--tasks", type=int, default=64, help="validation instances (train split, seed 0 + 5555)")
    p.add_argument("--samples", type=int, default=4, help="episodes per instance")
    p.add_argument("--json", default=None, help="where to write the numbers as JSON")
    p.add_argument("--report_unchanged_edits", action="store_true",
                   help="the tools answer \"No change\" to an edit that changes nothing (StudyConfig field)")
    args = p.parse_args(argv)
    bad = [x for x in args.policies if "=" not in x]
    if bad:
        p.error(f"expected name=policy_dir, got {bad}")
    if args.tasks < 1 or args.samples < 1:
        p.error(f"--tasks and --samples must be >= 1, got {args.tasks} and {args.samples}")
    cfg = StudyConfig(report_unchanged_edits=args.report_unchanged_edits)
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        result = site_outcomes(cfg, dict(x.split("=", 1) for x in args.policies), sandbox, args.tasks, args.samples)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(sites_markdown(result))
    print("\n".join(paired_rows(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
