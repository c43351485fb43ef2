"""The hand-written generalisation tasks (experiments/binary_search_rl/handwritten_tasks.py):
sound in the sandbox, shipped jsonl current, names disjoint from the generator's pools."""
import ast
import dataclasses
import os
import sys

import pytest

from experiments.binary_search_rl.handwritten_tasks import DEFAULT_PATH, handwritten_tasks
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import load_tasks
from jaxrl_agent.env.templates import TEMPLATES
from jaxrl_agent.env.templates.base import Template
from jaxrl_agent.env.tools import create_workspaces
from jaxrl_agent.env.verifier import check_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = handwritten_tasks()


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=1, timeout_s=20, memory_mb=512) as s:
        yield s


def test_eight_tasks_with_bug_records():
    assert len(TASKS) == 8 and len({t.task_id for t in TASKS}) == 8
    for t in TASKS:
        meta = t.metadata
        assert meta["template"].startswith("handwritten-") and meta["source_file"] in t.files
        assert meta["n_bugs"] == len(meta["bugs"]) in (1, 2)
        assert 8 <= len(t.files[meta["source_file"]].splitlines()) <= 25
        for bug in meta["bugs"]:  # the buggy lines are in the workspace, the fixed ones in the reference
            assert bug["buggy"] in t.files[meta["source_file"]]
            assert bug["fixed"] in t.reference_files[meta["source_file"]]


def test_tasks_pass_check_task_and_dev_tests_reveal_a_bug(sb, tmp_path):
    for i, t in enumerate(TASKS):
        assert check_task(t, sb) == [], t.task_id
        for label, files, want_fail in (("buggy", t.files, True),
                                        ("fixed", {**t.files, **t.reference_files}, False)):
            ws = create_workspaces({**files, **t.dev_tests}, str(tmp_path / f"{i}-{label}"), 1)[0]
            res = sb.run(ws, [sys.executable, "-m", "pytest", "-q", *sorted(t.dev_tests)],
                         timeout_s=10, test_timeout_s=0.5)
            assert res.error is None and (res.returncode != 0) == want_fail, (t.task_id, label, res.stdout[-500:])


def test_shipped_jsonl_is_current():
    assert load_tasks(os.path.join(ROOT, DEFAULT_PATH)) == TASKS


def test_names_are_not_the_generators():
    pools = set().union(*(v for t in TEMPLATES.values() for v in t.names.values()),
                               *(t.modules for t in TEMPLATES.values()),
                               next(f.default for f in dataclasses.fields(Template) if f.name == "modules"))
    for t in TASKS:
        for rel in t.files:
            for part in rel.removesuffix(".py").split("/"):
                assert part == "__init__" or part not in pools, (t.task_id, rel)
        tree = ast.parse(t.reference_files[t.metadata["source_file"]])
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert t.metadata["fn"] in defined
        for name in defined - {"__init__"}:
            assert name not in pools, (t.task_id, name)


def test_generator_wording_changes_only_the_instruction(tmp_path):
    from experiments.binary_search_rl.handwritten_tasks import in_generator_wording, main

    reworded = in_generator_wording(TASKS)
    for old, new in zip(TASKS, reworded):
        assert new.instruction != old.instruction and dataclasses.replace(new, instruction=old.instruction) == old
        assert new.instruction.startswith(f"The function `{old.metadata['fn']}` in `{old.metadata['source_file']}`")
        assert all(f"`{p}`" in new.instruction for p in old.dev_tests)
    main([str(tmp_path / "w.jsonl"), "--generator-wording"])
    assert load_tasks(str(tmp_path / "w.jsonl")) == reworded


def test_module_renamed_validation_instances_differ_only_in_the_file_name(tmp_path):
    """Made-up and pool module names pair up instance by instance: same function, bugs and
    test cases; the file, its tests and the instruction carry the new name; both sound."""
    from experiments.binary_search_rl.config import StudyConfig
    from experiments.binary_search_rl.handwritten_tasks import main, validation_with_module_names
    from experiments.binary_search_rl.stages import validation_tasks

    made_up = validation_with_module_names(6, made_up=True)
    pool = validation_with_module_names(6, made_up=False)
    originals = validation_tasks(StudyConfig(), 6)
    for a, b, o in zip(made_up, pool, originals):
        assert a.metadata["template"] == b.metadata["template"] == o.metadata["template"]
        assert (a.metadata["fn"], a.metadata["bugs"]) == (b.metadata["fn"], b.metadata["bugs"])
        mod = a.metadata["source_file"][:-3]
        assert mod not in TEMPLATES[a.metadata["template"]].modules
        assert b.metadata["source_file"][:-3] in TEMPLATES[b.metadata["template"]].modules
        assert f"`{a.metadata['source_file']}`" in a.instruction and list(a.files) == [a.metadata["source_file"]]
        assert all(f"from {mod} import" in t for t in a.hidden_tests.values())
    main([str(tmp_path / "m.jsonl"), "--made-up-modules=6"])
    assert load_tasks(str(tmp_path / "m.jsonl")) == made_up
    with pytest.raises(SystemExit, match="at most one"):
        main([str(tmp_path / "x.jsonl"), "--made-up-modules=2", "--generator-wording"])


def test_module_renamed_tasks_pass_check_task(sb):
    from experiments.binary_search_rl.handwritten_tasks import validation_with_module_names

    for t in validation_with_module_names(3, made_up=True):
        assert check_task(t, sb) == [], t.task_id


def test_demonstrations_on_made_up_modules_read_and_fix_the_listed_file(sb):
    """`made_up_modules` training data: the expert lists the files, reads the made-up one by
    its listed name and still fixes it (reward 1), so the path it writes is a copy."""
    from experiments.binary_search_rl.drills import module_renamed_tasks
    from jaxrl_agent.agent.demonstrations import collect_demonstrations
    from jaxrl_agent.env.tasks import generate_tasks
    from jaxrl_agent.tokenizer import ChatFormat, load_tokenizer

    tasks = module_renamed_tasks(generate_tasks("train", 2, 3), 3, made_up=True)
    chat = ChatFormat(load_tokenizer(), tool_style="short")
    for task, ep in zip(tasks, collect_demonstrations(tasks, sb, chat, ("perfect",), threads=1)):
        text = chat.tokenizer.decode(ep.ids)
        path = task.metadata["source_file"]
        assert ep.reward == 1.0 and path[:-3] not in TEMPLATES[task.metadata["template"]].modules
        assert text.index(f'"path": "{path}"') > text.index('"list_files"'), text[-800:]


def test_word_module_names_split_words_between_training_and_validation(sb, tmp_path):
    """English-word file names (`drills._word_name`): training draws and validation instances
    use disjoint halves of the words, never a hand-written task's name, never a bare stdlib
    module (which the tests' import would shadow); the renamed instances stay sound."""
    from experiments.binary_search_rl.drills import _HELD_OUT_NAMES, _word_list, module_renamed_tasks
    from experiments.binary_search_rl.handwritten_tasks import main, validation_with_module_names
    from jaxrl_agent.env.tasks import generate_tasks

    train, val = set(_word_list("train")), set(_word_list("validation"))
    assert train and val and not train & val
    assert {t.metadata["source_file"].rsplit("/", 1)[-1][:-3] for t in TASKS} <= _HELD_OUT_NAMES
    tasks = module_renamed_tasks(generate_tasks("train", 40, 3), 3, made_up=True, words=0.5)
    names = [t.metadata["source_file"][:-3] for t in tasks]
    worded = [n for n in names if n.split("_")[0] in train]
    assert 10 <= len(worded) <= 30  # about half, the rest syllables
    assert not set(names) & _HELD_OUT_NAMES and not set(names) & set(sys.stdlib_module_names)
    assert module_renamed_tasks(generate_tasks("train", 40, 3), 3, made_up=True) == \
        module_renamed_tasks(generate_tasks("train", 40, 3), 3, made_up=True, words=0.0)  # off: as before
    held = validation_with_module_names(4, made_up=False, words=True)
    for t in held:
        first = t.metadata["source_file"][:-3].split("_")[0]
        assert first in val and first not in train
        assert check_task(t, sb) == [], t.task_id
    main([str(tmp_path / "w.jsonl"), "--word-modules=4"])
    assert load_tasks(str(tmp_path / "w.jsonl")) == held
