"""The study's outputs: summary.json, plots, rendered trajectories and the results table.

Everything here reads the stage results (plain dicts); nothing is recomputed or tuned.
"""
from __future__ import annotations

import html
import json
import os
import subprocess

from experiments.binary_search_rl.diagnostics import diagnostics_markdown
from experiments.binary_search_rl.sites import failed_rows
from jaxrl_agent.agent.evaluation import paired_difference, pass_at_k_curve

LABELS = {"pretrain": "drilled base (no demos)", "sft": "SFT (all demos)",
          "sft_success_only": "SFT (successful demos only)",
          "rl": "RL (GRPO from SFT)", "control": "control (shuffled rewards)"}
SPLIT_LABELS = {"canonical": "canonical binary search", "heldout_instances": "held-out instances",
                "heldout_templates": "held-out templates"}
BEHAVIOUR_KEYS = ("ran_tests_before_submit", "fixed_all_bugs", "bugs_fixed_share", "recovered", "mean_turns",
                  "mean_edits", "interface_errors_per_episode", "tool_errors_per_episode")
PASS_KS = (1, 2, 4, 8)


# ---- the study's runs ----
def run_names(seeds, second_algo: str) -> dict[str, tuple[str | None, int, bool]]:
    """name -> (algo, None for the study's `rl.algo`; seed; rewards shuffled) of every RL run:
    "rl" / "control" for the first seed, "rl_seed{s}" / "control_seed{s}" for the others,
    and the second estimator under its own name with the first seed. No seeds: no run (the
    study stops at the gate's verdict and reports the SFT policies; `targets` says why)."""
    if not seeds:
        return {}
    out: dict[str, tuple[str | None, int, bool]] = {}
    for i, seed in enumerate(seeds):
        suffix = "" if i == 0 else f"_seed{seed}"
        out["rl" + suffix], out["control" + suffix] = (None, seed, False), (None, seed, True)
    if second_algo:
        if second_algo in out:
            raise ValueError(f"rl.second_algo {second_algo!r} clashes with a run name")
        out[second_algo] = (second_algo, seeds[0], False)
    return out


def is_main_run(name: str, runs: dict, algo: str) -> bool:
    """A run of the study's own estimator on true rewards (the runs the targets judge)."""
    return name in runs and runs[name][0] in (None, algo) and not runs[name][2]


def label(name: str, runs: dict | None = None) -> str:
    if name in LABELS:
        return LABELS[name]
    if runs and name in runs:
        algo, seed, shuffled = runs[name]
        base = "control (shuffled rewards" if shuffled else f"RL ({(algo or 'GRPO').upper()} from SFT"
        return f"{base}, seed {seed})"
    return name


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _split_entry(s: dict) -> dict:
    k = next((key for key in s if key.startswith("pass") and key[4:].isdigit() and key != "pass1"), None)
    out = {"pass1": s["pass1"], "ci_low": s["pass1_ci_low"], "ci_high": s["pass1_ci_high"],
           "n_episodes": s["n_episodes"], "n_tasks": s["n_tasks"]}
    if k is not None:
        out.update({k: s[k], f"{k}_ci_low": s[f"{k}_ci_low"], f"{k}_ci_high": s[f"{k}_ci_high"]})
    if "per_task" in s:
        out["pass_at_k"] = pass_at_k_curve(s["per_task"], PASS_KS)
    out["behaviour"] = {b: s["behaviour"][b] for b in BEHAVIOUR_KEYS if b in s["behaviour"]}
    out["failure_layers"] = s["behaviour"]["failure_layers"]
    out["terminations"] = s["terminations"]
    out["per_template"] = {t: v["pass1"] for t, v in s["per_template"].items()}
    if "bug_sites" in s:
        out["bug_sites"] = s["bug_sites"]
    return out


def targets(summary: dict) -> dict:
    """The issue's targets, each with the numbers it was judged on (per seed where there are
    seeds: a target over seeds is met only when it is met on every seed)."""
    runs = {n: tuple(v.values()) for n, v in summary["runs"].items()}
    algo = summary["config"]["rl"]["algo"]
    hi, can = summary["heldout_instances"], summary["canonical"]
    rl_runs = [n for n in runs if is_main_run(n, runs, algo) and n in can]
    controls = [n for n in runs if runs[n][2] and n in can]
    if "sft" not in can or not rl_runs:
        why = summary.get("gate", {}).get("reason") or (
            "no RL policy (see training.<run>.no_signal)" if runs else
            "no RL run in this build: the gate lets RL start, but rl.seeds is empty")
        return {"all": {"met": False, "reason": why}}
    sft = hi["sft"]
    gains = {n: hi[n]["pass1"] - sft["pass1"] for n in rl_runs}
    apart = {n: hi[n]["ci_low"] > sft["ci_high"] for n in rl_runs}
    out = {
        "canonical_rl_pass1_at_least_0.95": {
            "per_seed": {n: can[n]["pass1"] for n in rl_runs}, "episodes": {n: can[n]["n_episodes"] for n in rl_runs},
            "met": all(can[n]["pass1"] >= 0.95 and can[n]["n_episodes"] >= 200 for n in rl_runs)},
        "canonical_sft_start_at_most_0.70": {"value": can["sft"]["pass1"], "met": can["sft"]["pass1"] <= 0.70},
        "heldout_rl_minus_sft_at_least_0.25": {"per_seed": gains, "met": all(g >= 0.25 for g in gains.values()),
                                               **layer_ceiling(hi, rl_runs)},
        "heldout_intervals_do_not_overlap": {"per_seed": {n: [hi[n]["ci_low"], sft["ci_high"]] for n in rl_runs},
                                             "met": all(apart.values())},
        "control_gain_at_most_0.05": {"per_seed": {n: hi[n]["pass1"] - sft["pass1"] for n in controls},
                                      "met": bool(controls) and all(hi[n]["pass1"] - sft["pass1"] <= 0.05
                                                                     for n in controls)},
    }
    if "sft_success_only" in hi:
        base = hi["sft_success_only"]["pass1"]
        out["rl_minus_success_only_sft"] = {"per_seed": {n: hi[n]["pass1"] - base for n in rl_runs},
                                            "met": all(hi[n]["pass1"] > base for n in rl_runs)}
    other = [n for n in runs if runs[n][0] not in (None, algo) and n in hi]
    for n in other:
        out[f"{n}_minus_sft"] = {"value": hi[n]["pass1"] - sft["pass1"], "met": hi[n]["pass1"] - sft["pass1"] >= 0.25}
    return out


def layer_ceiling(hi: dict, rl_runs: list[str]) -> dict:
    """What bounds RL's held-out gain, by failure layer (DESIGN §9b): the SFT policy's failed
    share in each layer (episodes of held-out instances) and each RL run's. RL's job is the
    sequential layer, so `sft_failures["sequential"]` is the gain a policy that cured every
    sequential failure and nothing else would show; a larger gain must also cure basic ones.
    Shares of all episodes: pass@1 + the layers' shares = 1."""
    layers = ("basic", "sequential")
    return {"sft_failures": {k: hi["sft"]["failure_layers"].get(k, 0.0) for k in layers},
            **{f"{k}_failures_per_seed": {n: hi[n]["failure_layers"].get(k, 0.0) for n in rl_runs} for k in layers}}


def paired_training(training: dict, runs: dict) -> dict:
    """Each true-reward run against the control of its seed, on the training rollouts:
    success per iteration, paired by iteration (both runs draw the same tasks in the same
    order with the same sampling seeds, so task difficulty, which dominates one iteration's
    success, cancels). Over all iterations and over the second half (where updates have had
    time to act). Read on training tasks, never on a held-out set."""
    out = {}
    for name, (_, seed, shuffled) in runs.items():
        ctrl = next((c for c, (_, s, sh) in runs.items() if sh and s == seed), None)
        mine, theirs = (training.get(n, {}).get("train_reward") for n in (name, ctrl))
        if shuffled or ctrl is None or not mine or not theirs:
            continue
        a = [r["success"] for r in mine]
        b = [r["success"] for r in theirs][: len(a)]
        half = len(b) // 2
        out[name] = {"control": ctrl, "all": paired_difference(a[: len(b)], b),
                     "second_half": paired_difference(a[half: len(b)], b[half:])}
    return out


def paired_heldout(evals: dict, base: str = "sft", split: str = "heldout_instances") -> dict:
    """Every policy against `base` on the held-out instances, task by task: every policy is
    evaluated on the same tasks with the same sampling seeds, so the per-task pass rates pair,
    and how hard a task is cancels (the Wilson intervals of the targets do not pair)."""
    if base not in evals or "per_task" not in evals[base].get(split, {}):
        return {}
    ref = evals[base][split]["per_task"]
    out = {}
    for pol, e in evals.items():
        mine = e.get(split, {}).get("per_task")
        if pol == base or not mine:
            continue
        common = sorted(set(mine) & set(ref))
        if common:
            out[pol] = paired_difference([mine[t][0] / mine[t][1] for t in common],
                                         [ref[t][0] / ref[t][1] for t in common]) | {"tasks": len(common)}
    return out


def build_summary(cfg_dict: dict, stages: dict, evals: dict, runs: dict) -> dict:
    summary: dict = {"git_commit": git_commit(), "config": cfg_dict,
                     "runs": {n: {"algo": a or cfg_dict["rl"]["algo"], "seed": s, "shuffled_rewards": sh}
                              for n, (a, s, sh) in runs.items()}}
    for split in SPLIT_LABELS:
        summary[split] = {pol: _split_entry(e[split]) for pol, e in evals.items()}
    summary["gate"] = stages.get("gate", {})
    summary["training"] = {n: stages[n] for n in ("demos", *runs) if n in stages}
    for name in ("pretrain", "sft", "sft_success_only"):
        if name in stages and "nll" not in stages[name]:  # made elsewhere (`sft_from`)
            summary["training"][name] = dict(stages[name])
        elif name in stages:  # per-step NLL curves stay in the work dir; the summary keeps the end points
            nll = stages[name]["nll"]
            summary["training"][name] = {k: v for k, v in stages[name].items() if k != "nll"} | {
                "first_nll": nll[0], "final_nll": nll[-1]}
    summary["training_paired"] = paired_training(summary["training"], runs)
    summary["heldout_paired"] = paired_heldout(evals)
    summary["targets"] = targets(summary)
    summary["seconds"] = {name: round(st.get("seconds", 0.0), 1) for name, st in stages.items()}
    summary["seconds"].update({f"eval_{p}": round(e.get("seconds", 0.0), 1) for p, e in evals.items()})
    return summary


# ---- plots ----
def plot_all(summary: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {n: tuple(v.values()) for n, v in summary["runs"].items()}
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, (algo, _, shuffled) in runs.items():
        tr = summary["training"].get(name, {})
        if not tr.get("train_reward"):
            continue
        colour = "tab:grey" if shuffled else ("tab:blue" if algo == summary["config"]["rl"]["algo"] else "tab:orange")
        axes[0].plot([r["iteration"] for r in tr["train_reward"]], [r["reward"] for r in tr["train_reward"]],
                     color=colour, alpha=0.8, label=label(name, runs))
        axes[1].plot([c["iteration"] for c in tr["validation_curve"]],
                     [c["validation_pass1"] for c in tr["validation_curve"]], "o-", color=colour, alpha=0.8,
                     label=label(name, runs))
    axes[0].set(title="training reward per iteration", xlabel="iteration", ylabel="mean reward", ylim=(-0.02, 1.02))
    axes[1].set(title="validation instances: pass@1 during training", xlabel="iteration", ylabel="pass@1",
                ylim=(-0.02, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "training_curves.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(12, 4))
    shown = list(summary["canonical"])
    width = 0.8 / max(len(shown), 1)
    for j, pol in enumerate(shown):
        xs, ys, lo, hi = [], [], [], []
        for i, split in enumerate(SPLIT_LABELS):
            e = summary[split][pol]
            xs.append(i + (j - (len(shown) - 1) / 2) * width)
            ys.append(e["pass1"])
            lo.append(e["pass1"] - e["ci_low"])
            hi.append(e["ci_high"] - e["pass1"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label(pol, runs))
    ax.set_xticks(range(len(SPLIT_LABELS)), list(SPLIT_LABELS.values()))
    ax.set(ylabel="pass@1 (Wilson 95%)", ylim=(0, 1.05), title="final comparison")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "final_comparison.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---- trajectories ----
def _spans(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    spans, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            spans.append((mask[start], ids[start:i]))
            start = i
    return spans


def render_trajectory(example: dict, tokenizer, title: str) -> tuple[str, str]:
    """(HTML, Markdown) of one episode: policy tokens (loss_mask 1, trained on) green and
    bold / marked `▶`, prompt and observation tokens (loss_mask 0, masked) grey / marked `│`."""
    spans = _spans(example["ids"], example["loss_mask"])
    parts, lines = [], []
    for m, ids in spans:
        text = tokenizer.decode(ids)
        style = "color:#067d17;font-weight:bold;background:#eaffea" if m else "color:#777"
        parts.append(f'<span style="{style}">{html.escape(text)}</span>')
        lines += [("▶ " if m else "│ ") + line for line in text.split("\n")]
    head = f"{title} — reward {example['reward']}, termination {example['termination']}"
    page = (f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h3>{html.escape(head)}</h3><p><span style='color:#067d17;font-weight:bold'>policy tokens "
            "(loss_mask 1, trained on)</span> · <span style='color:#777'>prompt / observation tokens "
            "(loss_mask 0, masked)</span></p><pre style='white-space:pre-wrap'>" + "".join(parts) + "</pre></body></html>")
    md = (f"### {head}\n\n`▶` policy tokens (loss_mask 1, trained on) · `│` prompt / observation tokens "
          "(loss_mask 0, masked)\n\n```text\n" + "\n".join(lines) + "\n```\n")
    return page, md


# ---- the results table ----
def results_markdown(summary: dict) -> str:
    runs = {n: tuple(v.values()) for n, v in summary["runs"].items()}
    present = list(summary["canonical"])
    rows = ["| policy | canonical pass@1 | held-out instances pass@1 | held-out templates pass@1 |",
            "|---|---|---|---|"]
    for pol in present:
        cells = [f"{summary[s][pol]['pass1']:.3f} [{summary[s][pol]['ci_low']:.3f}, {summary[s][pol]['ci_high']:.3f}]"
                 for s in SPLIT_LABELS]
        rows.append(f"| {label(pol, runs)} | " + " | ".join(cells) + " |")
    spread = []
    algo = summary["config"]["rl"]["algo"]
    for kind, names in (("RL", [n for n in present if is_main_run(n, runs, algo)]),
                        ("control", [n for n in present if n in runs and runs[n][2]])):
        vals = [summary["heldout_instances"][n]["pass1"] for n in names]
        if vals:
            spread.append(f"| {kind} ({len(vals)} seeds) | {sum(vals) / len(vals):.3f} | {min(vals):.3f} | {max(vals):.3f} |")
    if spread:
        spread = ["", "| over seeds (held-out instances pass@1) | mean | min | max |", "|---|---|---|---|"] + spread
    passk = ["", "| held-out instances | " + " | ".join(f"pass@{k}" for k in PASS_KS) + " |",
             "|---" * (len(PASS_KS) + 1) + "|"]
    for pol in present:
        curve = summary["heldout_instances"][pol].get("pass_at_k", {})
        if f"pass{PASS_KS[-1]}" in curve:
            passk.append(f"| {label(pol, runs)} | " + " | ".join(f"{curve[f'pass{k}']['value']:.3f}" for k in PASS_KS) + " |")
    beh = ["", "| policy (held-out instances) | fixed every bug | tests run after the last edit, before submit | "
           "recovered after failing tests | turns | interface errors / ep | failures: interface / basic / sequential |",
           "|---|---|---|---|---|---|---|"]
    for pol in present:
        e = summary["heldout_instances"][pol]
        b, f = e["behaviour"], e["failure_layers"]
        layers = " / ".join(f"{f.get(k, 0.0):.2f}" for k in ("interface", "basic", "sequential"))
        beh.append(f"| {label(pol, runs)} | {b.get('fixed_all_bugs', 0):.2f} | {b.get('ran_tests_before_submit', 0):.2f} | "
                   f"{b.get('recovered', 0):.2f} | {b.get('mean_turns', 0):.1f} | "
                   f"{b.get('interface_errors_per_episode', 0):.2f} | {layers} |")
    sites = [(label(pol, runs), summary["heldout_instances"][pol]["bug_sites"]) for pol in present
             if "bug_sites" in summary["heldout_instances"][pol]]
    if sites:
        beh += ["", *failed_rows(sites, "held-out instances, failed episodes")]
    paired = []
    if summary.get("training_paired"):
        paired = ["", "| training success minus its control's, paired by iteration (same tasks) | iterations | "
                  "mean [95% bootstrap] | better / worse iterations | sign test p |", "|---|---|---|---|---|"]
        for pol, pr in summary["training_paired"].items():
            for part in ("all", "second_half"):
                paired.append(_paired_row(f"{label(pol, runs)}, {part.replace('_', ' ')}", pr[part]["n"], pr[part]))
    if summary.get("heldout_paired"):
        paired += ["", "| held-out instances: pass rate minus SFT's, paired by task (same tasks, same seeds) | tasks | "
                   "mean [95% bootstrap] | better / worse tasks | sign test p |", "|---|---|---|---|---|"]
        for pol, d in summary["heldout_paired"].items():
            paired.append(_paired_row(label(pol, runs), d["tasks"], d))
    gate = []
    if summary.get("gate"):
        g = summary["gate"]
        gate = ["", f"Gate (SFT policy, validation instances): pass@1 {g['pass1']:.3f}; share of failures by layer "
                + ", ".join(f"{k} {v:.2f}" for k, v in g["failure_layer_shares"].items())
                + ((" -> RL runs." if runs else " -> RL may start; not run (rl.seeds is empty).") if g["rl_starts"]
                   else f" -> no RL: {g['reason']}")]
    chosen = [f"{label(n, runs)} {summary['training'][n]['selected_iteration']}" for n in runs
              if summary.get("training", {}).get(n, {}).get("selected_iteration") is not None]
    if chosen:  # rl.keep_best: early stopping on the validation curve
        gate += ["", "Iteration of each RL policy (its best validation pass@1 after training began, ties to the "
                 "later): " + ", ".join(chosen) + "."]
    tg = ["", "| target | met | figure |", "|---|---|---|"]
    for name, t in summary["targets"].items():
        fig = "; ".join(_fmt(k, v) for k, v in t.items() if k != "met")
        tg.append(f"| {name} | {'yes' if t['met'] else 'no'} | {fig} |")
    diag = []
    if "diagnostics" in summary:
        diag = ["", diagnostics_markdown(summary["diagnostics"], LABELS).rstrip("\n")]
    return "\n".join(rows + spread + passk + beh + paired + gate + tg + diag) + "\n"


def _paired_row(name: str, n: int, d: dict) -> str:
    """One table row of a `paired_difference` result."""
    return (f"| {name} | {n} | {d['mean']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] | "
            f"{d['n_pos']} / {d['n_neg']} | {d['sign_p']:.3f} |")


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.3f}"
    if isinstance(value, dict):
        return f"{key} " + ", ".join(f"{n}: {_fmt('', v).strip()}" for n, v in value.items())
    if isinstance(value, list):
        return f"{key} [" + ", ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value) + "]"
    return f"{key} {value}"


def write_all(summary: dict, evals: dict, tokenizer, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = [os.path.join(out_dir, "summary.json")]
    with open(written[0], "w") as f:
        json.dump(summary, f, indent=1, default=str)
    written += plot_all(summary, out_dir)
    for tag, pol in (("before_rl", "sft"), ("after_rl", "rl")):
        if pol not in evals:
            continue
        page, md = render_trajectory(evals[pol]["example"], tokenizer,
                                     f"canonical task, {label(pol)}: first sampled episode")
        for ext, text in (("html", page), ("md", md)):
            written.append(os.path.join(out_dir, f"trajectory_{tag}.{ext}"))
            with open(written[-1], "w") as f:
                f.write(text)
    written.append(os.path.join(out_dir, "results.md"))
    with open(written[-1], "w") as f:
        f.write(results_markdown(summary))
    return written
