"""Silent-bug tasks (experiments/binary_search_rl/silent_bugs.py): the in-process dev-test
check agrees with pytest in the sandbox; the canonical task is silent; the RL pool is reweighted
to the asked share and unchanged at share 0."""
import sys

import pytest

from experiments.binary_search_rl.silent_bugs import (canonical_like_tasks, dev_tests_pass, partial_fixes, reweight,
                                                      rl_pool, silent_bug, silent_bug_tasks)
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import binary_search_task, generate_tasks
from jaxrl_agent.env.tools import create_workspaces

TASKS = generate_tasks("train", 40, 3)


def test_canonical_is_silent_fixing_low_alone():
    task = binary_search_task()
    sources = partial_fixes(task)
    assert len(sources) == 2 and silent_bug(task)
    low_fixed = [s for s in sources if "low = mid + 1" in s]
    assert len(low_fixed) == 1 and "high = mid\n" in low_fixed[0]
    assert dev_tests_pass(task, low_fixed[0])  # the dev tests pass with `high = mid` left
    assert not dev_tests_pass(task, task.files["bsearch.py"])  # ... and fail (a loop) on the buggy code
    assert dev_tests_pass(task, task.reference_files["bsearch.py"])


def test_one_bug_is_never_silent():
    single = [t for t in TASKS if t.metadata["n_bugs"] == 1]
    assert single and all(partial_fixes(t) is None and not silent_bug(t) for t in single)


def test_in_process_check_agrees_with_pytest_in_the_sandbox(tmp_path):
    multi = [t for t in TASKS if partial_fixes(t)][:6]
    assert len(multi) == 6
    seen = set()
    with Sandbox(num_workers=1, timeout_s=20, memory_mb=512) as sb:
        for i, t in enumerate(multi):
            for j, src in enumerate([t.files[t.metadata["source_file"]], *partial_fixes(t)]):
                files = {**t.files, t.metadata["source_file"]: src, **t.dev_tests}
                ws = create_workspaces(files, str(tmp_path / f"{i}-{j}"), 1)[0]
                res = sb.run(ws, [sys.executable, "-m", "pytest", "-q", *sorted(t.dev_tests)], timeout_s=10,
                             test_timeout_s=0.2)
                assert res.error is None
                passed = dev_tests_pass(t, src)
                assert passed == (res.returncode == 0), (t.task_id, j, res.stdout[-400:])
                seen.add(passed)
    assert seen == {True, False}  # both outcomes were compared


def test_reweight_hits_the_share_without_repeating_a_task():
    pool = generate_tasks("train", 200, 0)
    natural = sum(map(silent_bug, pool)) / len(pool)
    assert 0.1 < natural < 0.4
    for share in (0.1, 0.5, 0.8):
        out = reweight(pool, share, seed=0)
        ids = [t.task_id for t in out]
        assert len(set(ids)) == len(ids) and set(ids) <= {t.task_id for t in pool}
        assert sum(map(silent_bug, out)) / len(out) == pytest.approx(share, abs=0.02)
    assert [t.task_id for t in reweight(pool, 0.5, seed=0)] == [t.task_id for t in reweight(pool, 0.5, seed=0)]
    with pytest.raises(ValueError, match="share"):
        reweight(pool, 1.0, seed=0)
    with pytest.raises(ValueError, match="silent"):
        reweight([t for t in pool if t.metadata["n_bugs"] == 1], 0.5, seed=0)


def test_rl_pool_unchanged_at_share_zero_and_silent_validation_instances():
    assert rl_pool(30, 0) == generate_tasks("train", 30, 0)
    found = silent_bug_tasks("train", 5, 5555)
    assert len(found) == 5 and all(map(silent_bug, found))
    stream = {t.task_id for t in generate_tasks("train", 200, 5555)}
    assert {t.task_id for t in found} <= stream
    with pytest.raises(ValueError, match="max_scan"):
        silent_bug_tasks("train", 50, 5555, max_scan=64)


def test_canonical_like_instances_are_the_canonical_kind_and_never_the_canonical_task():
    canonical = binary_search_task()
    tasks = canonical_like_tasks(6, seed=0)
    assert len(tasks) == 6 and all(map(silent_bug, tasks))
    for t in tasks:
        assert t.metadata["template"] == canonical.metadata["template"]
        assert [b["fixed"].strip()[-3:] for b in t.metadata["bugs"]] == ["+ 1", "- 1"]  # lo = mid + 1, hi = mid - 1
        assert t.files[t.metadata["source_file"]] != canonical.files["bsearch.py"]
        # the lo bug loops on the last element, as on the canonical task: the dev tests fail
        assert not dev_tests_pass(t, t.files[t.metadata["source_file"]])
    # training (seed 0) and validation (5555) draws share no instance; both are deterministic
    assert not {t.task_id for t in tasks} & {t.task_id for t in canonical_like_tasks(6, seed=5555)}
    assert canonical_like_tasks(6, seed=0) == tasks


def test_rl_pool_adds_the_canonical_kind_at_its_share():
    base = rl_pool(60, 0)
    pool = rl_pool(60, 0, canonical_share=0.25)
    added = [t for t in pool if t.task_id.startswith("canonical-like-0-")]
    assert len(pool) == 80 and len(added) == 20
    assert {t.task_id for t in pool} - {t.task_id for t in added} == {t.task_id for t in base}
    with pytest.raises(ValueError, match="canonical-like share"):
        rl_pool(60, 0, canonical_share=1.0)


def test_main_writes_the_study_validation_instances(tmp_path):
    from experiments.binary_search_rl import stages
    from experiments.binary_search_rl.config import StudyConfig
    from experiments.binary_search_rl.silent_bugs import VALIDATION_SEED, main
    from jaxrl_agent.env.tasks import load_tasks

    assert VALIDATION_SEED == StudyConfig().seed + stages.VALIDATION_SEED_OFFSET
    main([str(tmp_path / "s.jsonl"), "--tasks=3"])
    assert load_tasks(str(tmp_path / "s.jsonl")) == silent_bug_tasks("train", 3, VALIDATION_SEED)
    main([str(tmp_path / "n.jsonl"), "--tasks=4", "--natural"])
    assert load_tasks(str(tmp_path / "n.jsonl")) == stages.validation_tasks(StudyConfig(), 4)
    main([str(tmp_path / "c.jsonl"), "--tasks=2", "--canonical-like"])
    assert load_tasks(str(tmp_path / "c.jsonl")) == canonical_like_tasks(2, VALIDATION_SEED)
    for bad in (["--heldout"], ["--natural", "--canonical-like"]):
        with pytest.raises(SystemExit, match="usage"):
            main([str(tmp_path / "x.jsonl"), *bad])
