"""Tasks whose dev tests pass with a bug still in the code (HOST): where RL's decision pays.

On the canonical task the dev tests reveal one of the two bugs; once it is fixed they pass,
and a policy that trusts them submits with the other bug left. A quarter of the training pool
is like that (509 of `generate_tasks("train", 2000, 0)`); the rest reveal every bug, so there
the verifier never pays for the decision "passing dev tests are not the end". This module
finds such instances, reweights the RL pool to a chosen share of them, and draws validation
instances of that kind:

    generate_tasks(train, n, seed)  --silent_bug-->  silent | other  --reweight(share)-->  RL pool
    generate_tasks(train, ., seed + 5555)  --silent_bug_tasks-->  silent validation instances
    bsearch_find, both bound bugs (seed | 5555)  --canonical_like_tasks-->  RL pool share | validation

A task is *silent* when fixing some but not all of its bugs makes every dev test pass (the
hidden tests catch each bug alone: `make_instance` checks that). The check runs
the generator's own dev tests in-process on the generator's own code, never an agent's: it is
the task generator's kind of check (`tasks._call`), not the sandbox's.
"""
from __future__ import annotations

import itertools
import random
import re
import sys

from jaxrl_agent.env.tasks import TEMPLATES, Task, _call, generate_tasks, make_instance, save_tasks


def partial_fixes(task: Task) -> list[str] | None:
    """The source with each nonempty proper subset of the bugs fixed, or None when the fixes
    cannot be applied unambiguously (a bug's text not exactly once in the file, or all fixes
    together not giving the reference)."""
    meta = task.metadata
    path = meta.get("source_file")
    bugs = meta.get("bugs") or []
    if path not in task.files or path not in task.reference_files or len(bugs) < 2:
        return None
    source = task.files[path]
    if any(source.count(b["buggy"]) != 1 for b in bugs):
        return None

    def fixed(subset) -> str:
        out = source
        for b in subset:
            out = out.replace(b["buggy"], b["fixed"], 1)
        return out

    if fixed(bugs) != task.reference_files[path]:
        return None
    return [fixed(sub) for k in range(1, len(bugs)) for sub in itertools.combinations(bugs, k)]


def dev_tests_pass(task: Task, source: str) -> bool:
    """Every dev test of `task` passes on `source` (run in-process, loops cut by a line budget)."""
    module = task.metadata["module"]
    importing = re.compile(rf"^(from {re.escape(module)} import .*|import {re.escape(module)})$")
    for text in task.dev_tests.values():
        body = "".join(line for line in text.splitlines(keepends=True) if not importing.match(line.strip()))
        combined = f"{source}\n\n{body}"
        for name in re.findall(r"^def (test_\w+)\(", body, flags=re.M):
            status, _ = _call(combined, name, ())
            if status != "ok":
                return False
    return True


def silent_bug(task: Task) -> bool:
    """True when the dev tests pass with some, not all, of the bugs fixed."""
    sources = partial_fixes(task)
    return bool(sources) and any(dev_tests_pass(task, s) for s in sources)


def silent_bug_tasks(split: str, n: int, seed: int, *, max_scan: int = 20000) -> list[Task]:
    """The first `n` silent instances of `split` in the stream `generate_tasks(split, ., seed)`;
    deterministic in (split, n, seed). Raises ValueError if `max_scan` instances hold fewer."""
    found: list[Task] = []
    scanned, chunk = 0, max(64, 8 * n)  # a quarter of the training pool is silent: 8n usually hold n
    while len(found) < n:
        if scanned >= max_scan:
            raise ValueError(f"only {len(found)} of {n} silent-bug instances in the first {scanned} of split "
                             f"{split!r} (seed {seed}): ask for fewer or raise max_scan")
        upto = min(scanned + chunk, max_scan)
        # the stream is prefix-stable (instance i depends on (split, seed, i) only): check the new part
        found += [t for t in generate_tasks(split, upto, seed)[scanned:] if silent_bug(t)]
        scanned = upto
    return found[:n]


def reweight(tasks: list[Task], share: float, seed: int) -> list[Task]:
    """`tasks` with the silent ones making up `share` of the result: every silent task and as
    many of the others as that share allows (or, for a share below the natural one, every
    other task and as many silent ones); shuffled with `seed`. The pool shrinks rather than
    repeats a task: 2000 training tasks at share 0.5 give about 1000."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"silent-bug share must be in (0, 1), got {share}: the pool needs both kinds")
    flags = [silent_bug(t) for t in tasks]
    silent = [t for t, f in zip(tasks, flags) if f]
    other = [t for t, f in zip(tasks, flags) if not f]
    if not silent or not other:
        raise ValueError(f"{len(silent)} of {len(tasks)} tasks are silent: no pool at share {share} can be made")
    if len(silent) * (1.0 - share) <= len(other) * share:  # the silent ones are the scarce kind
        other = other[:max(1, round(len(silent) * (1.0 - share) / share))]
    else:
        silent = silent[:max(1, round(len(other) * share / (1.0 - share)))]
    pool = silent + other
    random.Random(f"silent-reweight|{seed}").shuffle(pool)
    return pool


def rl_pool(n: int, seed: int, share: float = 0.0, canonical_share: float = 0.0) -> list[Task]:
    """The RL training tasks: `generate_tasks("train", n, seed)` (what `rl.train_rl` draws by
    default), reweighted to `share` silent tasks when `share` is not 0, then with
    `canonical_like_tasks(., seed)` added to make up `canonical_share` of the result (the
    canonical task's kind, drawn with the training seed: never the validation instances,
    which use VALIDATION_SEED, nor the canonical task itself); shuffled with `seed`."""
    tasks = generate_tasks("train", n, seed)
    pool = reweight(tasks, share, seed) if share else tasks
    if not canonical_share:
        return pool
    if not 0.0 < canonical_share < 1.0:
        raise ValueError(f"canonical-like share must be in [0, 1), got {canonical_share}")
    k = max(1, round(len(pool) * canonical_share / (1.0 - canonical_share)))
    pool = pool + canonical_like_tasks(k, seed)
    random.Random(f"canonical-mix|{seed}").shuffle(pool)
    return pool


VALIDATION_SEED = 5555
"""The study's validation instances: train split, `StudyConfig.seed` 0 + stages.VALIDATION_SEED_OFFSET."""


def canonical_like_tasks(n: int, seed: int = VALIDATION_SEED) -> list[Task]:
    """`n` instances of the canonical task's kind with other names and inputs: `bsearch_find`
    with its two bound bugs (`lo = mid`, `hi = mid`), dev tests of typical values and the last
    element, kept only when silent (fix `lo` alone and the dev tests pass, as on the canonical
    task). Deterministic in (n, seed); the canonical task itself (`tasks.binary_search_task`,
    names low/high/mid, module bsearch, fixed inputs) is never drawn: its names are skipped."""
    tpl, out, i = TEMPLATES["bsearch_find"], [], 0
    while len(out) < n:
        if i > 50 * n + 100:  # a generous bound: far past it the template no longer makes this kind
            raise ValueError(f"only {len(out)} of {n} canonical-like instances in {i} draws")
        rng = random.Random(f"canonical-like|{seed}|{i}")
        i += 1
        task = make_instance(tpl, rng, split="train", seed=seed, sites=[(0, 0), (1, 0)],
                             dev_kinds=("typical", "last"))
        names = (task.metadata["fn"], task.metadata["module"])
        if names == ("binary_search", "bsearch") or not silent_bug(task):
            continue
        task.task_id = f"canonical-like-{seed}-{i - 1}"
        out.append(task)
    return out


def main(argv: list[str] | None = None) -> None:
    """`OUT.jsonl [--tasks=N] [--natural | --canonical-like]`: the first N (default 32) silent
    validation instances, or with `--natural` the first N validation instances whatever they
    are, or with `--canonical-like` `canonical_like_tasks(N)`, as a task file for
    `python -m jaxrl_agent eval --eval.task_file=OUT.jsonl` (choices are made on these, never on
    a held-out set)."""
    args = sys.argv[1:] if argv is None else argv
    paths = [a for a in args if not a.startswith("--")]
    flags = dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in args if a.startswith("--"))
    if len(paths) != 1 or set(flags) - {"tasks", "natural", "canonical-like"} or \
            {"natural", "canonical-like"} <= set(flags):
        raise SystemExit("usage: python -m experiments.binary_search_rl.silent_bugs OUT.jsonl [--tasks=N] "
                         "[--natural | --canonical-like]")
    n = int(flags.get("tasks", 32))
    natural = "natural" in flags
    if "canonical-like" in flags:
        tasks, what = canonical_like_tasks(n), "canonical-like validation"
    elif natural:
        tasks, what = generate_tasks("train", n, VALIDATION_SEED), "validation"
    else:
        tasks, what = silent_bug_tasks("train", n, VALIDATION_SEED), "silent-bug validation"
    save_tasks(paths[0], tasks)
    print(f"wrote {len(tasks)} {what} instances "
          f"({sum(map(silent_bug, tasks))} silent) to {paths[0]}")


if __name__ == "__main__":
    main()
