"""HOST: evaluation that explains, not only counts (DESIGN §9b).

- `wilson_interval`, `pass_at_k` (the unbiased estimator of Chen et al. 2021);
- `paired_difference`: two runs measured on the same items (e.g. an RL run and its
  shuffled-reward control on the same tasks, iteration by iteration): mean difference,
  bootstrap interval and sign test;
- `episode_behaviour`: what an episode did (tests run before submitting, edits, recovery
  after a failing test run, tool / interface errors) and, for a failure, the layer where it
  happened: "interface" (the call never reached the environment as meant), "basic" (legal
  calls that made no progress: no edit applied, no injected bug fixed, never submitted),
  "sequential" (progress made - some bug fixed - and submitted, outcome wrong), or
  "infrastructure" (a sandbox / verifier error: not the policy's fault);
- `bug_outcomes`: each injected bug of a generated task as the final source left it (fixed,
  left as injected, changed) and lines rewritten away from every bug;
- `summarize_episodes`: pass@1 / pass@k with Wilson 95% intervals, per template, plus the
  behaviour statistics and, per bug site, the outcomes, as one JSON-ready dict.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np

from jaxrl_agent.env.tool_calls import EDIT_TOOLS  # a leaf itself: names only

FAILURE_LAYERS = ("interface", "basic", "sequential", "infrastructure")


# ---- statistics ----
def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default); (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_curve(per_task: dict, ks: Sequence[int] = (1, 2, 4, 8)) -> dict[str, dict]:
    """pass@k for each k in `ks` from {task: [successes, episodes]} (tasks with fewer than k
    episodes are left out of that k), with a Wilson interval over tasks as `summarize_episodes`."""
    out = {}
    for k in ks:
        usable = [(c, n) for c, n in per_task.values() if n >= k]
        if not usable:
            continue
        pk = float(np.mean([pass_at_k(n, c, k) for c, n in usable]))
        lo, hi = wilson_interval(pk * len(usable), len(usable))
        out[f"pass{k}"] = {"value": pk, "ci_low": lo, "ci_high": hi, "n_tasks": len(usable)}
    return out


def paired_difference(a: Sequence[float], b: Sequence[float], *, n_boot: int = 10_000, seed: int = 0,
                      level: float = 0.95) -> dict:
    """a - b over items measured by both (shapes: a, b [n]).

    Pairing removes what the items share: two RL runs that see the same tasks in the same
    order differ per iteration by far less than the tasks' difficulty varies between
    iterations, so the paired difference sees a gain the unpaired means hide.

        d_i = a_i - b_i;  mean = (1/n) sum_i d_i
        interval: percentile bootstrap of the mean over items (n_boot resamples, seeded);
        sign_p: exact two-sided sign test over the non-tied pairs (n' = n_pos + n_neg),
                min(1, 2 * sum_{j <= min(n_pos, n_neg)} C(n', j) / 2^n').

    The items are treated as independent; consecutive iterations of one run are not quite
    (both policies drift), so read the interval as approximate. Reference: Efron &
    Tibshirani, An Introduction to the Bootstrap (1993), ch. 13; Conover, Practical
    Nonparametric Statistics (1999), §3.4.
    """
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs two sequences of the same length, got {len(a)} and {len(b)}")
    if not len(a):
        raise ValueError("paired_difference needs at least one pair")
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    boot = d[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(axis=1)
    tail = (1.0 - level) / 2
    n_pos, n_neg = int((d > 0).sum()), int((d < 0).sum())
    m = n_pos + n_neg
    p = min(1.0, 2 * sum(math.comb(m, j) for j in range(min(n_pos, n_neg) + 1)) / 2 ** m) if m else 1.0
    return {"n": len(d), "mean": float(d.mean()), "ci_low": float(np.quantile(boot, tail)),
            "ci_high": float(np.quantile(boot, 1.0 - tail)), "n_pos": n_pos, "n_neg": n_neg, "sign_p": p}


# ---- one episode ----
def _test_run_failed(observation: str) -> bool:
    return any(w in observation for w in (" failed", " error", "FAILED", "ERROR", "timed out", "No tests ran"))


def episode_behaviour(history: Sequence, termination: str | None, reward: float,
                      bugs: tuple[int, int] | None = None, sites: dict | None = None) -> dict:
    """Behaviour of one episode from its `ToolSession.history` of (text, StepResult).

    Failure layers: "interface" (parse-error limit, or interface errors and no edit), "basic"
    (no edit applied, never submitted, or - with `bugs`, (bugs fixed, bugs injected) from
    `bugs_fixed` - edits that fixed none of the bugs or "fixed" all and still fail, whatever
    was decided after them), and "sequential": progress made, then submitted after a failing
    test run that followed the last edit (did not recover), or with some but not all bugs
    fixed (stopped too early). Without `bugs` (a user's task) progress is unknown, and a
    submit after a failing run counts as sequential. `sites` (`bug_outcomes`) is kept as
    "bug_sites" for `summarize_episodes`' per-site table."""
    names = []
    interface_errors = tool_errors = edits = 0
    read_file = ran_tests = tests_after_last_edit = saw_failure = edit_after_failure = False
    failing_after_last_edit = False  # the last test run after an edit failed: recovery was called for
    for _, step in history:
        if step.error is not None:
            interface_errors += 1
            continue
        name = step.call.name
        names.append(name)
        if not step.tool_ok:
            tool_errors += 1
        if name == "read_file" and step.tool_ok:
            read_file = True
        elif name in EDIT_TOOLS and step.tool_ok:
            edits += 1
            tests_after_last_edit = failing_after_last_edit = False
            edit_after_failure = edit_after_failure or saw_failure
        elif name == "run_tests":
            ran_tests = True
            tests_after_last_edit = True
            saw_failure = saw_failure or _test_run_failed(step.observation)
            failing_after_last_edit = edits > 0 and _test_run_failed(step.observation)
    submitted = termination == "submitted"
    success = reward >= 1.0
    if success:
        layer = None
    elif termination == "sandbox_error":
        layer = "infrastructure"
    elif termination == "parse_error_limit" or (interface_errors > 0 and edits == 0):
        layer = "interface"
    elif edits == 0 or not submitted:
        layer = "basic"
    elif bugs is not None and bugs[1] > 0 and (bugs[0] == 0 or bugs[0] == bugs[1]):
        # no bug fixed, or every bug "fixed" and yet wrong: the edits were wrong. This comes
        # before "did not recover": without progress there is no decision to blame (§9b)
        layer = "basic"
    elif failing_after_last_edit:
        layer = "sequential"  # progress, then submitted although the last test run failed
    else:
        layer = "sequential"  # some bugs fixed, submitted without the rest
    return {
        "turns": len(history), "tool_calls": {n: names.count(n) for n in sorted(set(names))},
        "interface_errors": interface_errors, "tool_errors": tool_errors, "edits": edits,
        "read_file": read_file, "ran_tests": ran_tests,
        "ran_tests_before_submit": submitted and ran_tests and tests_after_last_edit,
        "saw_failing_tests": saw_failure,
        "recovered": success and edit_after_failure,
        "submitted": submitted, "failure_layer": layer,
        **({"bugs_fixed": bugs[0], "bugs_total": bugs[1]} if bugs is not None else {}),
        **({"bug_sites": sites} if sites is not None else {}),
    }


def bugs_fixed(task, files: dict[str, str]) -> tuple[int, int]:
    """(bugs fixed, bugs injected) of `task` judged from the final source `files`.

    A bug (`task.metadata["bugs"]`: the changed lines of its one-bug version) counts as fixed
    when its buggy lines occur no more often than in the reference and its fixed lines at
    least as often. Text-level, so a correct fix written differently counts as not fixed; the
    verifier's reward stays the judge of success, this only explains partial progress.
    Metadata without well-formed bug records (e.g. a task file's free `"bugs": 2`) gives (0, 0):
    unknown, never an exception.
    """
    out = bug_outcomes(task, files)
    return (0, 0) if out is None else (out["outcomes"].count("fixed"), len(out["outcomes"]))


BUG_OUTCOMES = ("fixed", "untouched", "changed")
FAILED_SITE_KINDS = ("site_changed_wrongly", "line_elsewhere_rewritten", "site_left_as_injected", "every_site_fixed")
"""What a failed episode's sites show (`summarize_episodes`' "bug_sites"), the first that applies."""


def bug_outcomes(task, files: dict[str, str]) -> dict | None:
    """What the final source `files` did to each injected bug of `task`, and where else it wrote.

    Per bug (in `task.metadata["bugs"]` order; its site `"<template>/<site index>"` from
    `metadata["bug_sites"]`): "fixed" (as `bugs_fixed` counts it), "untouched" (its buggy lines
    occur as often as in the starting file: left as injected) or "changed" (neither: a wrong fix,
    or the lines rewritten). `stray_lines`: lines of the final source that neither the reference
    nor the starting file holds, counted with multiplicity (lines the policy wrote wrongly);
    `elsewhere`: those beyond one per changed bug, i.e. lines written away from every bug (a wrong
    place chosen). Text-level like `bugs_fixed`. A missing source file leaves every bug
    "changed". None when the metadata holds no well-formed bug records (a user's task file).

    Returns {"sites": [str], "outcomes": [str], "stray_lines": int, "elsewhere": int}.
    """
    meta = task.metadata if isinstance(task.metadata, dict) else {}
    bugs, path = meta.get("bugs"), meta.get("source_file")
    # free metadata (a user's task file) may hold anything: only well-formed bug records count
    if not isinstance(bugs, list) or not all(isinstance(b, dict) and isinstance(b.get("buggy"), str)
                                             and isinstance(b.get("fixed"), str) for b in bugs):
        return None
    where = meta.get("bug_sites")
    where = where if isinstance(where, list) and len(where) == len(bugs) else [None] * len(bugs)
    sites = [f"{meta.get('template', '')}/{w[0]}" if isinstance(w, (list, tuple)) and w else "?" for w in where]
    known = isinstance(path, str) and path in files and path in task.reference_files and path in task.files
    if not known:
        return {"sites": sites, "outcomes": ["changed"] * len(bugs), "stray_lines": 0, "elsewhere": 0}
    final, ref, start = files[path], task.reference_files[path], task.files[path]
    outcomes = []
    for b in bugs:
        if final.count(b["buggy"]) <= ref.count(b["buggy"]) and final.count(b["fixed"]) >= ref.count(b["fixed"]):
            outcomes.append("fixed")
        elif final.count(b["buggy"]) >= start.count(b["buggy"]):
            outcomes.append("untouched")
        else:
            outcomes.append("changed")
    lines = Counter(final.splitlines()) - Counter(ref.splitlines()) - Counter(start.splitlines())
    stray = sum(lines.values())
    return {"sites": sites, "outcomes": outcomes, "stray_lines": stray,
            "elsewhere": max(0, stray - outcomes.count("changed"))}


# ---- many episodes ----
def summarize_episodes(episodes: Sequence, k: int) -> dict:
    """pass@1 / pass@k with Wilson intervals, per template, and behaviour statistics.

    `episodes` are `trajectory.Episode`s with `info["task_id"]`, `info["template"]` and
    `info["behaviour"]` (as `rollout.collect_episodes` returns them), several per task.
    pass@1 is the mean success over all episodes (interval over episodes); pass@k is the
    mean over tasks of the unbiased estimator (interval over tasks, counting a task as a
    success with probability pass@k). `per_task` keeps [successes, episodes] per task id, so
    pass@k for any other k up to the samples per task can be computed later (`pass_at_k_curve`).
    """
    by_task: dict[str, list] = {}
    for e in episodes:
        by_task.setdefault(e.info["task_id"], []).append(e)

    def block(eps: Sequence) -> dict:
        rewards = np.array([e.reward >= 1.0 for e in eps], np.float64)
        tasks: dict[str, list] = {}
        for e in eps:
            tasks.setdefault(e.info["task_id"], []).append(e.reward >= 1.0)
        n1 = len(rewards)
        p1 = float(rewards.mean()) if n1 else 0.0
        lo1, hi1 = wilson_interval(rewards.sum(), n1)
        out = {"n_episodes": n1, "n_tasks": len(tasks), "pass1": p1, "pass1_ci_low": lo1, "pass1_ci_high": hi1}
        usable = [v for v in tasks.values() if len(v) >= k]
        if usable:
            pk = float(np.mean([pass_at_k(len(v), int(sum(v)), k) for v in usable]))
            lok, hik = wilson_interval(pk * len(usable), len(usable))
            out.update({f"pass{k}": pk, f"pass{k}_ci_low": lok, f"pass{k}_ci_high": hik})
        return out

    summary = block(episodes)
    summary["per_task"] = {t: [int(sum(e.reward >= 1.0 for e in v)), len(v)] for t, v in by_task.items()}
    templates: dict[str, list] = {}
    for e in episodes:
        templates.setdefault(e.info.get("template", ""), []).append(e)
    summary["per_template"] = {t: block(v) for t, v in sorted(templates.items())}
    beh = [e.info["behaviour"] for e in episodes]
    n = max(len(beh), 1)
    summary["behaviour"] = {
        "mean_turns": sum(b["turns"] for b in beh) / n,
        "mean_edits": sum(b["edits"] for b in beh) / n,
        "ran_tests_before_submit": sum(b["ran_tests_before_submit"] for b in beh) / n,
        "read_file": sum(b["read_file"] for b in beh) / n,
        "recovered": sum(b["recovered"] for b in beh) / n,
        **_bug_statistics(beh),
        "interface_errors_per_episode": sum(b["interface_errors"] for b in beh) / n,
        "tool_errors_per_episode": sum(b["tool_errors"] for b in beh) / n,
        "failure_layers": {layer: sum(b["failure_layer"] == layer for b in beh) / n for layer in FAILURE_LAYERS},
    }
    terms: dict[str, int] = {}
    for e in episodes:
        terms[e.termination] = terms.get(e.termination, 0) + 1
    summary["terminations"] = terms
    sites = _site_statistics([(b["bug_sites"], e.reward >= 1.0, e.termination == "submitted")
                              for b, e in zip(beh, episodes) if b.get("bug_sites")])
    if sites:
        summary["bug_sites"] = sites
    return summary


def _site_statistics(known: Sequence[tuple[dict, bool, bool]]) -> dict:
    """From (`bug_outcomes`, success, submitted) per episode: per bug site, the share of its
    injected bugs each outcome ends in; and the failed episodes by what their sites show,
    the first that applies: a site changed wrongly (the fix not known), a line written away
    from every bug (a correct line rewritten: a wrong place chosen), a site left as injected
    (not found, or stopped before it), every site fixed (the failure lies elsewhere); with,
    per kind, the share of the failed episodes that also never submitted (ran out of tokens or
    turns)."""
    if not known:
        return {}
    counts: dict[str, list[int]] = {}
    for sites, _, _ in known:
        for site, outcome in zip(sites["sites"], sites["outcomes"]):
            c = counts.setdefault(site, [0] * len(BUG_OUTCOMES))
            c[BUG_OUTCOMES.index(outcome)] += 1
    failed = [(s, submitted) for s, ok, submitted in known if not ok]
    why = [("site_changed_wrongly" if "changed" in s["outcomes"] else "line_elsewhere_rewritten" if s["elsewhere"]
            else "site_left_as_injected" if "untouched" in s["outcomes"] else "every_site_fixed") for s, _ in failed]
    n = max(len(failed), 1)
    return {"per_site": {site: {"bugs": sum(c), **{o: k / sum(c) for o, k in zip(BUG_OUTCOMES, c)}}
                         for site, c in sorted(counts.items())},
            "failed_episodes": len(failed),
            "failed_with": {k: why.count(k) / n for k in FAILED_SITE_KINDS},
            "failed_not_submitted": {k: sum(w == k and not sub for w, (_, sub) in zip(why, failed)) / n
                                     for k in FAILED_SITE_KINDS}}


def _bug_statistics(behaviours: Sequence[dict]) -> dict:
    """Share of episodes that fixed every injected bug / at least one, and of bugs fixed,
    over the episodes whose behaviour carries `bugs_fixed` (rollouts add it)."""
    known = [b for b in behaviours if b.get("bugs_total")]
    if not known:
        return {}
    return {"fixed_all_bugs": sum(b["bugs_fixed"] == b["bugs_total"] for b in known) / len(known),
            "fixed_some_bug": sum(b["bugs_fixed"] > 0 for b in known) / len(known),
            "bugs_fixed_share": sum(b["bugs_fixed"] for b in known) / sum(b["bugs_total"] for b in known)}


# ---- display ----
def render_trajectory(episode, tokenizer, max_chars: int = 4000):
    """A rich Text of one episode: policy tokens (loss_mask 1) in bold green, observation /
    prompt tokens (loss_mask 0, masked out of the loss) dimmed."""
    from rich.text import Text

    text = Text()
    spans, cur, start = [], None, 0
    for i, m in enumerate(episode.loss_mask + [None]):
        if m != cur:
            if cur is not None:
                spans.append((cur, episode.ids[start:i]))
            cur, start = m, i
    shown = 0
    for m, ids in spans:
        piece = tokenizer.decode(ids)
        if shown + len(piece) > max_chars:
            piece = piece[: max(0, max_chars - shown)] + " ..."
        text.append(piece, style="bold green" if m == 1 else "dim")
        shown += len(piece)
        if shown >= max_chars:
            break
    return text
