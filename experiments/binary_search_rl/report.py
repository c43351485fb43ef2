"""The study's outputs: summary.json, plots, rendered trajectories and the results table.

Everything here reads the stage results (plain dicts); nothing is recomputed or tuned.
"""
from __future__ import annotations

import html
import json
import os
import subprocess

from experiments.binary_search_rl.diagnostics import diagnostics_markdown

POLICIES = ("sft", "sft_success_only", "rl", "control")
LABELS = {"pretrain": "drilled base (no demos)", "sft": "SFT (all demos)",
          "sft_success_only": "SFT (successful demos only)",
          "rl": "RL (GRPO from SFT)", "control": "control (shuffled rewards)"}
SPLIT_LABELS = {"canonical": "canonical binary search", "heldout_instances": "held-out instances",
                "heldout_templates": "held-out templates"}
BEHAVIOUR_KEYS = ("ran_tests_before_submit", "fixed_all_bugs", "bugs_fixed_share", "recovered", "mean_turns",
                  "mean_edits", "interface_errors_per_episode", "tool_errors_per_episode")


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
    out["behaviour"] = {b: s["behaviour"][b] for b in BEHAVIOUR_KEYS if b in s["behaviour"]}
    out["failure_layers"] = s["behaviour"]["failure_layers"]
    out["terminations"] = s["terminations"]
    out["per_template"] = {t: v["pass1"] for t, v in s["per_template"].items()}
    return out


def targets(summary: dict) -> dict:
    """The issue's targets, each with the numbers it was judged on."""
    missing = [pol for pol in POLICIES if pol not in summary["canonical"]]
    if missing:
        return {"all": {"met": False, "reason": f"no policy for {missing}: see training.<name>.no_signal"}}

    def p(split, pol):
        return summary[split][pol]

    can_rl, can_sft = p("canonical", "rl"), p("canonical", "sft")
    hi = {pol: p("heldout_instances", pol) for pol in POLICIES}
    gain = hi["rl"]["pass1"] - hi["sft"]["pass1"]
    return {
        "canonical_rl_pass1_at_least_0.95": {"value": can_rl["pass1"], "met": can_rl["pass1"] >= 0.95},
        "canonical_sft_start_at_most_0.70": {"value": can_sft["pass1"], "met": can_sft["pass1"] <= 0.70},
        "heldout_rl_minus_sft_at_least_0.25": {"value": gain, "met": gain >= 0.25},
        "heldout_intervals_do_not_overlap": {"rl_ci_low": hi["rl"]["ci_low"], "sft_ci_high": hi["sft"]["ci_high"],
                                             "met": hi["rl"]["ci_low"] > hi["sft"]["ci_high"]},
        "control_gain_at_most_0.05": {"value": hi["control"]["pass1"] - hi["sft"]["pass1"],
                                      "met": hi["control"]["pass1"] - hi["sft"]["pass1"] <= 0.05},
        "rl_beats_success_only_sft": {"value": hi["rl"]["pass1"] - hi["sft_success_only"]["pass1"],
                                      "met": hi["rl"]["pass1"] > hi["sft_success_only"]["pass1"]},
    }


def build_summary(cfg_dict: dict, stages: dict, evals: dict) -> dict:
    summary: dict = {"git_commit": git_commit(), "config": cfg_dict}
    for split in SPLIT_LABELS:
        summary[split] = {pol: _split_entry(evals[pol][split]) for pol in POLICIES if pol in evals}
    summary["targets"] = targets(summary)
    summary["training"] = {"demos": stages["demos"], "rl": stages["rl"], "control": stages["control"]}
    for name in ("pretrain", "sft", "sft_success_only"):
        if name in stages:  # per-step NLL curves stay in the work dir; the summary keeps the end points
            nll = stages[name]["nll"]
            summary["training"][name] = {k: v for k, v in stages[name].items() if k != "nll"} | {
                "first_nll": nll[0], "final_nll": nll[-1]}
    summary["seconds"] = {name: round(st.get("seconds", 0.0), 1) for name, st in stages.items()}
    summary["seconds"].update({f"eval_{p}": round(e.get("seconds", 0.0), 1) for p, e in evals.items()})
    return summary


# ---- plots ----
def plot_all(summary: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, colour in (("rl", "tab:blue"), ("control", "tab:grey")):
        tr = summary["training"][name]
        if not tr.get("train_reward"):
            continue
        axes[0].plot([r["iteration"] for r in tr["train_reward"]], [r["reward"] for r in tr["train_reward"]],
                     color=colour, label=LABELS[name])
        axes[1].plot([c["iteration"] for c in tr["heldout_curve"]], [c["heldout_pass1"] for c in tr["heldout_curve"]],
                     "o-", color=colour, label=LABELS[name])
    axes[0].set(title="training reward per iteration", xlabel="iteration", ylabel="mean reward", ylim=(-0.02, 1.02))
    axes[1].set(title="held-out instances: pass@1 during training", xlabel="iteration", ylabel="pass@1",
                ylim=(-0.02, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "training_curves.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.2
    for j, pol in enumerate(p for p in POLICIES if p in summary["canonical"]):
        xs, ys, lo, hi = [], [], [], []
        for i, split in enumerate(SPLIT_LABELS):
            e = summary[split][pol]
            xs.append(i + (j - 1.5) * width)
            ys.append(e["pass1"])
            lo.append(e["pass1"] - e["ci_low"])
            hi.append(e["ci_high"] - e["pass1"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=LABELS[pol])
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
    rows = ["| policy | canonical pass@1 | held-out instances pass@1 | held-out templates pass@1 |",
            "|---|---|---|---|"]
    present = [pol for pol in POLICIES if pol in summary["canonical"]]
    for pol in present:
        cells = [f"{summary[s][pol]['pass1']:.3f} [{summary[s][pol]['ci_low']:.3f}, {summary[s][pol]['ci_high']:.3f}]"
                 for s in SPLIT_LABELS]
        rows.append(f"| {LABELS[pol]} | " + " | ".join(cells) + " |")
    beh = ["", "| policy (held-out instances) | tests run before submit | fixed every bug | recovered after failing "
           "tests | turns | interface errors / ep |", "|---|---|---|---|---|---|"]
    for pol in present:
        b = summary["heldout_instances"][pol]["behaviour"]
        beh.append(f"| {LABELS[pol]} | {b.get('ran_tests_before_submit', 0):.2f} | {b.get('fixed_all_bugs', 0):.2f} | "
                   f"{b.get('recovered', 0):.2f} | {b.get('mean_turns', 0):.1f} | "
                   f"{b.get('interface_errors_per_episode', 0):.2f} |")
    tg = ["", "| target | met | figure |", "|---|---|---|"]
    for name, t in summary["targets"].items():
        fig = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{v}" for k, v in t.items() if k != "met")
        tg.append(f"| {name} | {'yes' if t['met'] else 'no'} | {fig} |")
    diag = []
    if "diagnostics" in summary:
        diag = ["", diagnostics_markdown(summary["diagnostics"], LABELS).rstrip("\n")]
    return "\n".join(rows + beh + tg + diag) + "\n"


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
                                     f"canonical task, {LABELS[pol]}: first sampled episode")
        for ext, text in (("html", page), ("md", md)):
            written.append(os.path.join(out_dir, f"trajectory_{tag}.{ext}"))
            with open(written[-1], "w") as f:
                f.write(text)
    written.append(os.path.join(out_dir, "results.md"))
    with open(written[-1], "w") as f:
        f.write(results_markdown(summary))
    return written
