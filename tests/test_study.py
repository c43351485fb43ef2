"""The study command (experiments/binary_search_rl) end to end on a tiny setting: every stage
runs, the summary has the keys the issue names, plots and trajectories are written, and a
second invocation reuses the finished stages instead of recomputing them."""
import json
import os

import pytest

from experiments.binary_search_rl import stages
from experiments.binary_search_rl.__main__ import main
from experiments.binary_search_rl.ablate import SERIES
from experiments.binary_search_rl.ablate import main as ablate_main
from experiments.binary_search_rl.ablate import run_ablation
from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.report import run_names
from jaxrl_agent.cli.main import apply_overrides

POLICIES = ("sft", "sft_success_only", *run_names((0, 1), "rloo"))
TINY = ["--rl.seeds=0,1", "--gate.tasks=1", "--gate.samples=1", "--gate.min_sequential_share=0",
        "--eval.passk_samples=2", "--pretrain.num_tasks=4", "--pretrain.steps=2", "--pretrain.copy_steps=2", "--demos.num_tasks=3", "--sft.steps=2", "--sft.batch_size=2", "--rl.iterations=1", "--rl.tasks_per_iter=1",
        "--rl.group_size=2", "--rl.mini_batches=1", "--rl.num_train_tasks=2", "--rl.eval_every=1", "--rl.curve_tasks=1",
        "--rl.require_signal=false", "--rl.silent_bug_share=0", "--eval.canonical_samples=2", "--eval.heldout_instance_tasks=1",
        "--eval.heldout_template_tasks=1", "--eval.samples_per_task=1", "--diagnose.tasks=2", "--model.num_layers=1",
        "--model.hidden_size=32", "--model.num_heads=2", "--model.num_kv_heads=1", "--model.intermediate_size=64"]


@pytest.mark.slow
def test_study_runs_every_stage_and_writes_the_summary(tmp_path, capsys):
    args = TINY + [f"--work_dir={tmp_path / 'work'}", f"--results_dir={tmp_path / 'results'}"]
    assert main(args + ["--jobs=2"]) == 0  # stages side by side in worker processes; every call below: --jobs=1
    args.append("--jobs=1")
    res = tmp_path / "results"
    summary = json.loads((res / "summary.json").read_text())
    for split in ("canonical", "heldout_instances", "heldout_templates"):
        for pol in POLICIES:
            e = summary[split][pol]
            assert 0.0 <= e["ci_low"] <= e["pass1"] <= e["ci_high"] <= 1.0
    assert summary["canonical"]["sft"]["n_episodes"] == 2
    assert summary["config"]["sft"]["steps"] == 2 and len(summary["git_commit"]) >= 7
    assert set(summary["targets"]) >= {"canonical_rl_pass1_at_least_0.95", "control_gain_at_most_0.05"}
    diag = summary["diagnostics"]
    assert diag["tasks"] == 2 and set(diag["per_policy"]) == {"pretrain", *POLICIES}
    for per_tool in diag["per_policy"].values():
        assert per_tool["all"]["turns"] >= 2 * 3  # read, run tests, submit at least, per episode
        assert 0.0 <= per_tool["all"]["exact"] <= per_tool["all"]["token_accuracy"] <= 1.0
    assert "teacher-forced" in (res / "results.md").read_text()
    # every evaluation reads each injected bug from the final source (evaluation.bug_outcomes)
    sites = summary["heldout_instances"]["sft"]["bug_sites"]
    assert sum(c["bugs"] for c in sites["per_site"].values()) >= 1 and "failed_with" in sites
    assert "held-out instances, failed episodes: what their sites show" in (res / "results.md").read_text()
    for name in ("training_curves.png", "final_comparison.png", "trajectory_before_rl.html",
                 "trajectory_after_rl.md", "results.md"):
        assert (res / name).stat().st_size > 0, name
    md = (res / "trajectory_after_rl.md").read_text()
    assert "\n▶ " in md                        # policy tokens are marked
    assert "│ <|im_start|>system" in md           # the prompt is masked
    # the control really permuted rewards and both runs logged iteration metrics
    assert summary["training"]["rl"]["train_reward"] and summary["training"]["control"]["train_reward"]
    # rl.keep_best (on by default): one iteration, so its policy is the best one, exported as such
    for run in ("rl", "control"):
        assert summary["training"][run]["selected_iteration"] == 1
        assert summary["training"][run]["policy"].endswith(os.path.join(run, "best_policy"))
    assert "Iteration of each RL policy" in (res / "results.md").read_text()
    # a stage run in a worker gives what it gives in this process (the RL run, from the same SFT policy)
    cfg = apply_overrides(StudyConfig(), TINY + [f"--work_dir={tmp_path / 'serial'}"])
    here = stages.rl(cfg, "rl", {"policy": str(tmp_path / "work" / "sft" / "policy")}, shuffle_rewards=False)
    assert here["train_reward"] == summary["training"]["rl"]["train_reward"]
    capsys.readouterr()
    # the per-site table of the study's SFT policy on one validation instance
    from experiments.binary_search_rl.sites import main as sites_main
    assert sites_main([f"sft={tmp_path / 'work' / 'sft' / 'policy'}", "--tasks=1", "--samples=1",
                       f"--json={tmp_path / 'sites.json'}"]) == 0
    assert "| sft (pass@1" in capsys.readouterr().out
    assert json.loads((tmp_path / "sites.json").read_text())["sft"]["bug_sites"]["per_site"]
    # second invocation: every stage comes from the work dir (no SFT step is printed again)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[sft] step" not in out and "[pretrain] step" not in out and "[rl] iter" not in out
    assert os.path.exists(tmp_path / "work" / "sft" / "policy" / "model.safetensors")
    # an ablation reuses the study's SFT policy and judges the setting on training data only
    study_rl_stamp = (tmp_path / "work" / "rl" / "stamp.json").read_text()
    assert ablate_main(args + ["--name=shaped", "--rl.tool_error_penalty=-0.1"]) == 0
    out = capsys.readouterr().out
    assert "[sft] step" not in out and "| control | success |" in out
    ab = json.loads((tmp_path / "work" / "ablations" / "shaped" / "ablation.json").read_text())
    assert ab["rl"]["tool_error_penalty"] == -0.1 and ab["validation"]["split"] == "train"
    for run in ("rl", "control"):
        series = ab["runs"][run]["series"]
        assert all(len(series[k]) == 1 for k in SERIES), series
        assert 0.0 <= ab["runs"][run]["validation_pass1"]["after"] <= 1.0
    assert (tmp_path / "work" / "rl" / "stamp.json").read_text() == study_rl_stamp  # the study's RL is untouched
    assert json.loads((res / "ablations" / "shaped.json").read_text()) == ab  # the committed copy
    assert ablate_main(args + ["--summarize=true"]) == 0
    assert "| shaped | control |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="plain directory name"):
        run_ablation(StudyConfig(work_dir=str(tmp_path / "work")), "../escape")
    # the RL half from a given SFT policy: no demonstration, drill or SFT step; no success-only row
    given = tmp_path / "work" / "sft" / "policy"
    half = [a for a in args if not a.startswith(("--rl.seeds", "--results_dir"))]
    assert main(half + ["--rl.seeds=0", "--rl.second_algo=", f"--sft_from={given}", f"--results_dir={tmp_path / 'half'}",
                        f"--policies_dir={tmp_path / 'shipped'}"]) == 0
    out = capsys.readouterr().out
    assert "[sft] step" not in out and "demonstrations:" not in out and "[pretrain" not in out
    half_summary = json.loads((tmp_path / "half" / "summary.json").read_text())
    assert set(half_summary["heldout_instances"]) == {"sft", "rl", "control"}
    assert half_summary["training"]["sft"]["given"] and "demos" not in half_summary["training"]
    assert all((tmp_path / "shipped" / p / "model.safetensors").exists() for p in ("sft", "rl"))
    # an ablation from the given SFT policy, on a pool reweighted toward silent-bug tasks
    assert ablate_main(half + [f"--sft_from={given}", f"--results_dir={tmp_path / 'half'}", "--name=silent",
                               "--control=false", "--rl.silent_bug_share=0.5", "--rl.num_train_tasks=40"]) == 0
    out = capsys.readouterr().out
    assert "[sft] step" not in out and "| rl | success |" in out and "| control |" not in out
    saved = json.loads((tmp_path / "work" / "ablations" / "silent" / "rl" / "stamp.json").read_text())
    assert saved["stamp"]["rl"]["silent_bug_share"] == 0.5 and saved["stamp"]["start"] == str(given)
    with pytest.raises(ValueError, match="not an HF policy directory"):
        main(half + [f"--sft_from={tmp_path}", f"--results_dir={tmp_path / 'half'}"])
    with pytest.raises(ValueError, match="needs the SFT stage"):
        main(half + [f"--sft_from={given}", "--ship_demo_policy=true"])


def test_study_rejects_a_bad_override():
    with pytest.raises(SystemExit):
        main(["--sft.nonexistent=3"])


def test_drills_copy_lines_exactly_and_leave_the_fixed_file(tmp_path):
    """Every drill edit is a valid copy (no tool error), the change-and-restore pairs cancel,
    and the workspace ends equal to the reference: drills teach copying, not wrong code."""
    import random

    from experiments.binary_search_rl.drills import drill_transcript
    from jaxrl_agent.env.tasks import generate_tasks, workspace_files
    from jaxrl_agent.env.tools import create_workspaces

    restores = 0
    for i, task in enumerate(generate_tasks("train", 12, 5)):
        tool_style = ("short", "full", "numbered", "lines")[i % 4]
        edit = '"str_replace"' if tool_style in ("full", "lines") else '"replace_lines"'
        ws = create_workspaces(workspace_files(task), str(tmp_path / str(i)), 1)[0]
        # extra_edits past the tools' turn limit (12): a drill once died on its own `submit`
        tr = drill_transcript(task, ws, random.Random(i), extra_edits=(12, 2)[i % 3 % 2], tool_style=tool_style)
        assert all(not obs.startswith("Error") for _, obs in tr.turns), tr.turns
        assert '"submit"' in tr.turns[-1][0]
        path = task.metadata["source_file"]
        with open(os.path.join(ws, path)) as f:
            assert f.read() == task.reference_files[path]
        # the fix takes at most one edit per bug; every other edit is a copy exercise
        restores += sum(edit in t for t, _ in tr.turns) - task.metadata["n_bugs"]
    assert restores > 0


def test_random_name_drill_instances_use_no_pool_names(tmp_path):
    """A share of 1 re-makes every instance with made-up names (none from the template's
    pools), still a checked task whose drill ends fixed; a share of 0 changes nothing."""
    import ast
    import random

    from experiments.binary_search_rl.drills import drill_transcript, random_name_tasks
    from jaxrl_agent.env.tasks import generate_tasks, workspace_files
    from jaxrl_agent.env.templates import TEMPLATES
    from jaxrl_agent.env.tools import create_workspaces

    tasks = generate_tasks("train", 6, 5)
    assert random_name_tasks(tasks, 0.0, 0) == tasks
    made = random_name_tasks(tasks, 1.0, 0)
    assert made == random_name_tasks(tasks, 1.0, 0)  # deterministic
    for i, (old, new) in enumerate(zip(tasks, made)):
        pools = {n for v in TEMPLATES[old.metadata["template"]].names.values() for n in v}
        assert new.metadata["template"] == old.metadata["template"]
        tree = ast.parse(new.files[new.metadata["source_file"]])
        idents = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args} | {new.metadata["fn"]}
        assert not pools & idents, pools & idents
        ws = create_workspaces(workspace_files(new), str(tmp_path / str(i)), 1)[0]
        tr = drill_transcript(new, ws, random.Random(i))
        assert all(not obs.startswith("Error") for _, obs in tr.turns), tr.turns
        with open(os.path.join(ws, new.metadata["source_file"])) as f:
            assert f.read() == new.reference_files[new.metadata["source_file"]]


def test_copy_sequences_are_a_prefix_then_its_repeat_with_loss_on_the_repeat():
    """Each sequence is a random prefix of length m then that prefix repeated: every loss
    token equals the token m back (learnable only by copying), none of the prefix is trained."""
    from experiments.binary_search_rl.drills import copy_sequences

    ids = [5, 9, 11, 40, 41, 77, 300, 301]
    seqs = copy_sequences(20, ids, length=64, seed=3)
    assert [s.ids for s in seqs] == [s.ids for s in copy_sequences(20, ids, length=64, seed=3)]
    periods = set()
    for s in seqs:
        assert len(s.ids) == len(s.loss_mask) == 64 and set(s.ids) <= set(ids)
        m = s.loss_mask.index(1) - 1  # loss from the repeat's second token on
        assert 8 <= m <= 32 and not any(s.loss_mask[:m + 1]) and all(s.loss_mask[m + 1:])
        assert all(s.ids[t] == s.ids[t - m] for t in range(m, 64))
        periods.add(m)
    assert len(periods) > 3  # the copy distance varies from row to row
    with pytest.raises(ValueError, match="length >= 16"):
        copy_sequences(1, ids, length=8)


def test_whole_transcript_loss_covers_everything_after_the_shared_prompt():
    """Drills as pretraining: loss on every token after the prompt all episodes share (tool
    results included), none on that prompt; ids and everything else unchanged."""
    from experiments.binary_search_rl.drills import whole_transcript_loss
    from jaxrl_agent.trajectory import Episode

    prompt = [7, 8, 9]
    eps = [Episode(prompt + [1, 2, 3, 4], [0, 0, 0, 1, 0, 0, 1], [0.0] * 7, [0] * 7, reward=1.0, group_id=4),
           Episode(prompt + [5, 6], [0, 0, 0, 0, 1], [0.0] * 5, [0] * 5)]
    out = whole_transcript_loss(eps)
    assert [e.loss_mask for e in out] == [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert [e.ids for e in out] == [e.ids for e in eps] and (out[0].reward, out[0].group_id) == (1.0, 4)
    assert eps[0].loss_mask == [0, 0, 0, 1, 0, 0, 1]  # the input is not modified
    with pytest.raises(ValueError, match="at least two"):
        whole_transcript_loss(eps[:1])
    with pytest.raises(ValueError, match="only the shared prompt"):
        whole_transcript_loss([eps[0], Episode(prompt, [0, 0, 0], [0.0] * 3, [0] * 3)])


def test_turn_accuracy_scores_whole_turns_by_tool():
    """An expert turn counts only when every one of its tokens is predicted; grouped by tool."""
    import numpy as np

    from experiments.binary_search_rl.diagnostics import turn_accuracy
    from jaxrl_agent.env.tool_calls import format_tool_call
    from jaxrl_agent.tokenizer import load_tokenizer
    from jaxrl_agent.trajectory import Episode

    tok = load_tokenizer()
    ids, mask, turn = tok.encode("<|im_start|>user\nfix it<|im_end|>\n"), [], []
    mask, turn = [0] * len(ids), [0] * len(ids)
    calls = [("read_file", {"path": "a.py"}), ("str_replace", {"path": "a.py", "old": "x = 1", "new": "x = 2"}),
             ("submit", {})]
    for k, (name, args) in enumerate(calls):
        call = tok.encode(format_tool_call(name, args))
        obs = tok.encode("<|im_start|>user\nok<|im_end|>\n")
        ids, mask, turn = ids + call + obs, mask + [1] * len(call) + [0] * len(obs), turn + [k] * (len(call) + len(obs))
    ep = Episode(ids, mask, [0.0] * len(ids), turn)
    target = np.array(ids[1:] + [0], np.int32)  # perfect next-token predictions

    def perfect(x, m):
        return np.broadcast_to(np.pad(target, (0, x.shape[1] - len(target))), x.shape)

    wrong_at = next(t for t in range(len(ids)) if mask[t] and turn[t] == 1) + 3  # inside the str_replace turn

    def one_wrong(x, m):
        out = np.array(perfect(x, m))
        out[:, wrong_at - 1] = (ids[wrong_at] + 1) % tok.vocab_size
        return out

    good = turn_accuracy([ep], perfect, tok.decode, max_len=256)
    n_policy = sum(mask)
    assert good["all"] == {"turns": 3, "exact": 1.0, "token_accuracy": 1.0, "tokens_per_turn": n_policy / 3}
    bad = turn_accuracy([ep], one_wrong, tok.decode, max_len=256)
    assert bad["str_replace"]["exact"] == 0.0 and bad["read_file"]["exact"] == bad["submit"]["exact"] == 1.0
    n = sum(1 for t in range(len(ids)) if mask[t] and turn[t] == 1)
    assert bad["str_replace"]["token_accuracy"] == (n - 1) / n


def test_edit_turn_tokens_split_into_line_numbers_copied_text_and_the_fix():
    """A replace_lines turn's tokens: its line numbers, the text the replaced line already
    holds (a copy), and the text the edit changes (the fix); scored apart under teacher forcing."""
    import numpy as np

    from experiments.binary_search_rl.diagnostics import edit_parts, turn_accuracy
    from jaxrl_agent.env.tasks import binary_search_task, workspace_files
    from jaxrl_agent.env.tool_calls import format_tool_call
    from jaxrl_agent.tokenizer import load_tokenizer
    from jaxrl_agent.trajectory import Episode

    tok = load_tokenizer()
    task = binary_search_task()
    files = workspace_files(task)
    path = task.metadata["source_file"]
    assert files[path].split("\n")[9] == "            low = mid"
    call = tok.encode(format_tool_call("replace_lines", {"path": path, "start": 10, "end": 10,
                                                         "text": "            low = mid + 1"}) + "<|im_end|>")
    parts = edit_parts(call, tok.decode, files)
    text = lambda part: "".join(tok.decode([t]) for t, p in zip(call, parts) if p == part)
    assert text("lines") == "1010" and text("fix").strip() == "+ 1"
    assert text("copy").strip() == "low = mid" and text("tool") == "replace_lines" and path in text("other")
    assert edit_parts(tok.encode(format_tool_call("submit", {})), tok.decode, files) is None
    assert edit_parts(call, tok.decode, {}) is None  # a file the task does not have

    head = tok.encode("<|im_start|>user\nfix it<|im_end|>\n")
    ids = head + call
    ep = Episode(ids, [0] * len(head) + [1] * len(call), [0.0] * len(ids), [0] * len(ids))
    target = np.array(ids[1:] + [0], np.int32)
    first_fix = len(head) + parts.index("fix")

    def predict(wrong_at):
        def f(x, m):
            out = np.array(np.broadcast_to(np.pad(target, (0, x.shape[1] - len(target))), x.shape))
            if wrong_at is not None:
                out[:, wrong_at - 1] = (ids[wrong_at] + 1) % tok.vocab_size
            return out
        return f

    good = turn_accuracy([ep], predict(None), tok.decode, max_len=128, files=[files])["edit_parts"]
    assert all(good[p]["token_accuracy"] == 1.0 and good[p]["turns_all_right"] == 1.0 for p in ("lines", "copy", "fix"))
    bad = turn_accuracy([ep], predict(first_fix), tok.decode, max_len=128, files=[files])["edit_parts"]
    assert bad["fix"]["turns_all_right"] == 0.0 and bad["fix"]["token_accuracy"] == pytest.approx(1 - 1 / bad["fix"]["tokens"])
    assert bad["copy"]["turns_all_right"] == bad["lines"]["turns_all_right"] == 1.0
    assert bad["fix"]["first_error_at"] == [1, 0, 0, 0] and good["fix"]["first_error_at"] == [0, 0, 0, 0]
    first = lambda wrong_at: turn_accuracy([ep], predict(wrong_at), tok.decode, max_len=128,
                                           files=[files])["edit_first_wrong"]
    assert first(None) == {"turns": 0, "by_part": {}, "tool_wanted": {}}
    assert first(first_fix) == {"turns": 1, "by_part": {"fix": 1}, "tool_wanted": {}}
    # a wrong token in the tool's name: the edit turn fails on a decision, and says what it wanted
    at_tool = len(head) + parts.index("tool")
    instead = tok.decode([(ids[at_tool] + 1) % tok.vocab_size])
    assert first(at_tool) == {"turns": 1, "by_part": {"tool": 1}, "tool_wanted": {instead.strip() or repr(instead): 1}}
    assert "edit_parts" not in turn_accuracy([ep], predict(None), tok.decode, max_len=128)
    # by the edit's place in its episode: the tool name (a decision) apart from every other token
    place = lambda wrong_at: turn_accuracy([ep], predict(wrong_at), tok.decode, max_len=128,
                                           files=[files])["edit_by_place"]
    assert place(None) == {"1": {"turns": 1, "tool_right": 1.0, "arguments_right": 1.0}}
    assert place(first_fix) == {"1": {"turns": 1, "tool_right": 1.0, "arguments_right": 0.0}}
    assert place(at_tool) == {"1": {"turns": 1, "tool_right": 0.0, "arguments_right": 1.0}}
    twice = Episode(head + call + call, [0] * len(head) + [1] * 2 * len(call), [0.0] * (len(head) + 2 * len(call)),
                    [0] * (len(head) + len(call)) + [1] * len(call))
    wrong_second = len(head) + len(call) + parts.index("tool")
    target2 = np.array(twice.ids[1:] + [0], np.int32)

    def second_tool_wrong(x, m):
        out = np.array(np.broadcast_to(np.pad(target2, (0, x.shape[1] - len(target2))), x.shape))
        out[:, wrong_second - 1] = (twice.ids[wrong_second] + 1) % tok.vocab_size
        return out

    assert turn_accuracy([twice], second_tool_wrong, tok.decode, max_len=128, files=[files])["edit_by_place"] == {
        "1": {"turns": 1, "tool_right": 1.0, "arguments_right": 1.0},
        "2": {"turns": 1, "tool_right": 0.0, "arguments_right": 1.0}}


def test_str_replace_turn_tokens_split_into_the_old_lines_copied_text_and_the_fix():
    """A whole-line str_replace turn ("lines" style): `old` is its address, the new line's
    unchanged text a copy, its changed text the fix."""
    from experiments.binary_search_rl.edits import edit_parts
    from jaxrl_agent.env.tasks import binary_search_task, workspace_files
    from jaxrl_agent.env.tool_calls import format_tool_call
    from jaxrl_agent.tokenizer import load_tokenizer

    tok = load_tokenizer()
    task = binary_search_task()
    files = workspace_files(task)
    path = task.metadata["source_file"]
    call = tok.encode(format_tool_call("str_replace", {"path": path, "old": "            low = mid",
                                                       "new": "            low = mid + 1"}) + "<|im_end|>")
    parts = edit_parts(call, tok.decode, files)
    text = lambda part: "".join(tok.decode([t]) for t, p in zip(call, parts) if p == part)
    assert text("old") == "            low = mid" and text("copy") == "            low = mid"
    assert text("fix").strip() == "+ 1" and "lines" not in parts
    bad = tok.encode(format_tool_call("str_replace", {"path": path, "old": 3, "new": "x"}))
    assert edit_parts(bad, tok.decode, files) is None


def _fake_split(p1: float, n: int = 200) -> dict:
    return {"pass1": p1, "pass1_ci_low": max(0.0, p1 - 0.1), "pass1_ci_high": min(1.0, p1 + 0.1), "n_episodes": n,
            "n_tasks": 5, "behaviour": {"mean_turns": 5.0, "failure_layers": {"sequential": 1 - p1}},
            "terminations": {"submitted": 10}, "per_template": {"t": {"pass1": p1}}}


def test_report_without_rl_says_why_and_still_writes_the_sft_results(tmp_path):
    """When RL refused to start (no signal), the report keeps the SFT figures and marks the
    targets unmet with the reason instead of crashing or inventing numbers."""
    from experiments.binary_search_rl import report
    from jaxrl_agent.tokenizer import load_tokenizer

    split = {s: _fake_split(0.2) for s in report.SPLIT_LABELS}
    example = {"ids": [1, 2, 3], "loss_mask": [0, 1, 1], "reward": 0.0, "termination": "max_turns"}
    evals = {"sft": {**split, "example": example}, "sft_success_only": dict(split)}
    stages = {"demos": {"seconds": 1.0}, "sft": {"nll": [2.0, 1.0], "seconds": 1.0},
              "sft_success_only": {"nll": [2.0, 1.5], "seconds": 1.0},
              "rl": {"policy": None, "no_signal": "pass@8 is 0", "seconds": 1.0},
              "control": {"policy": None, "no_signal": "pass@8 is 0", "seconds": 1.0}}
    summary = report.build_summary({"seed": 0, "rl": {"algo": "grpo"}}, stages, evals, report.run_names((0,), ""))
    assert summary["targets"]["all"]["met"] is False and "no_signal" in summary["targets"]["all"]["reason"]
    assert set(summary["canonical"]) == {"sft", "sft_success_only"}
    written = report.write_all(summary, evals, load_tokenizer(), str(tmp_path))
    assert not any("after_rl" in w for w in written)
    assert "SFT (all demos)" in (tmp_path / "results.md").read_text()


def test_report_with_no_rl_seeds_says_rl_was_not_run(tmp_path):
    """`--rl.seeds=` stops the study at the gate even when the gate lets RL start: no run is
    named, and the targets and the table say RL was not run rather than that it failed."""
    from experiments.binary_search_rl import report

    assert report.run_names((), "rloo") == {}
    split = {s: _fake_split(0.5) for s in report.SPLIT_LABELS}
    stages = {"demos": {"seconds": 1.0}, "sft": {"nll": [2.0, 1.0], "seconds": 1.0},
              "gate": {"pass1": 0.6, "failure_layer_shares": {"basic": 0.4, "sequential": 0.6}, "rl_starts": True,
                       "reason": None}}
    summary = report.build_summary({"seed": 0, "rl": {"algo": "grpo"}}, stages, {"sft": dict(split)}, {})
    assert summary["targets"] == {"all": {"met": False, "reason": "no RL run in this build: the gate lets RL start, "
                                                                  "but rl.seeds is empty"}}
    assert "RL may start; not run (rl.seeds is empty)" in report.results_markdown(summary)


def test_report_targets_follow_the_numbers():
    """Targets over seeds hold only when they hold on every seed; the gate's reason is kept."""
    from experiments.binary_search_rl import report

    runs = report.run_names((0, 1), "rloo")
    p = {"sft": 0.3, "sft_success_only": 0.4, "rl": 0.97, "rl_seed1": 0.96, "control": 0.32, "control_seed1": 0.3,
         "rloo": 0.9}
    summary = {"runs": {n: {"algo": a or "grpo", "seed": sd, "shuffled_rewards": sh} for n, (a, sd, sh) in runs.items()},
               "config": {"rl": {"algo": "grpo"}}}
    summary |= {s: {n: report._split_entry(_fake_split(v)) for n, v in p.items()} for s in report.SPLIT_LABELS}
    t = report.targets(summary)
    assert t["canonical_rl_pass1_at_least_0.95"]["met"] and t["canonical_sft_start_at_most_0.70"]["met"]
    assert t["heldout_rl_minus_sft_at_least_0.25"]["met"] and t["heldout_intervals_do_not_overlap"]["met"]
    assert t["control_gain_at_most_0.05"]["met"] and t["rl_minus_success_only_sft"]["met"]
    assert set(t["heldout_rl_minus_sft_at_least_0.25"]["per_seed"]) == {"rl", "rl_seed1"}
    assert t["rloo_minus_sft"]["value"] == pytest.approx(0.6)
    gain = t["heldout_rl_minus_sft_at_least_0.25"]  # what bounds the gain, by layer
    assert gain["sft_failures"] == {"basic": 0.0, "sequential": pytest.approx(0.7)}
    assert gain["sequential_failures_per_seed"] == {"rl": pytest.approx(0.03), "rl_seed1": pytest.approx(0.04)}
    summary["heldout_instances"]["control_seed1"] = report._split_entry(_fake_split(0.5))
    assert not report.targets(summary)["control_gain_at_most_0.05"]["met"]
    summary["heldout_instances"]["rl_seed1"] = report._split_entry(_fake_split(0.5))
    assert not report.targets(summary)["heldout_rl_minus_sft_at_least_0.25"]["met"]
    summary["canonical"]["rl"] = report._split_entry(_fake_split(0.99, n=100))  # too few episodes to judge
    assert not report.targets(summary)["canonical_rl_pass1_at_least_0.95"]["met"]
    del summary["canonical"]["rl"], summary["canonical"]["rl_seed1"]
    summary["gate"] = {"reason": "70% of the failures are basic"}
    assert report.targets(summary) == {"all": {"met": False, "reason": "70% of the failures are basic"}}


def test_report_pairs_each_run_with_the_control_of_its_seed():
    """Training success is compared iteration by iteration with the same seed's control."""
    from experiments.binary_search_rl import report

    runs = report.run_names((0, 1), "rloo")
    curve = lambda xs: {"train_reward": [{"iteration": i + 1, "success": x} for i, x in enumerate(xs)]}
    training = {"rl": curve([0.1, 0.5, 0.2, 0.4]), "control": curve([0.1, 0.4, 0.1, 0.2]),
                "rl_seed1": curve([0.3, 0.3, 0.3, 0.3]), "control_seed1": curve([0.5, 0.5, 0.5, 0.5]),
                "rloo": curve([0.1, 0.4, 0.1, 0.2])}
    out = report.paired_training(training, runs)
    assert set(out) == {"rl", "rl_seed1", "rloo"}  # controls are not compared with themselves
    assert out["rl"]["control"] == "control" and out["rl_seed1"]["control"] == "control_seed1"
    assert out["rl"]["all"]["mean"] == pytest.approx(0.1) and out["rl"]["all"]["n_pos"] == 3
    assert out["rl"]["second_half"]["n"] == 2 and out["rl"]["second_half"]["mean"] == pytest.approx(0.15)
    assert out["rl_seed1"]["all"]["mean"] == pytest.approx(-0.2) and out["rl_seed1"]["all"]["n_neg"] == 4
    assert out["rloo"]["all"]["mean"] == 0.0 and out["rloo"]["all"]["sign_p"] == 1.0
    del training["control_seed1"]  # a control that did not run: its seed's run is left out
    assert set(report.paired_training(training, runs)) == {"rl", "rloo"}


def test_report_pairs_held_out_tasks_with_the_sft_policy():
    from experiments.binary_search_rl import report

    per = lambda d: {"heldout_instances": {"per_task": d}}
    evals = {"sft": per({"a": [1, 8], "b": [0, 8], "c": [4, 8]}), "rl": per({"a": [3, 8], "b": [0, 8], "c": [6, 8]}),
             "control": per({"a": [0, 8], "c": [4, 8]}), "sft_success_only": {"heldout_instances": {}}}
    out = report.paired_heldout(evals)
    assert set(out) == {"rl", "control"}  # a policy without per-task counts is left out
    assert out["rl"]["tasks"] == 3 and out["rl"]["mean"] == pytest.approx(4 / 8 / 3)
    assert (out["rl"]["n_pos"], out["rl"]["n_neg"]) == (2, 0)
    assert out["control"]["tasks"] == 2 and out["control"]["mean"] == pytest.approx(-1 / 16)
    assert report.paired_heldout({"rl": evals["rl"]}) == {}  # no SFT evaluation: nothing to pair with


def test_gate_starts_rl_only_when_most_failures_are_decisions():
    from experiments.binary_search_rl.stages import gate_decision

    ok = gate_decision({"interface": 0.05, "basic": 0.1, "sequential": 0.3, "infrastructure": 0.0}, 0.5)
    assert ok["rl_starts"] and ok["reason"] is None and ok["failure_layer_shares"]["sequential"] == pytest.approx(2 / 3)
    bad = gate_decision({"interface": 0.1, "basic": 0.5, "sequential": 0.2, "infrastructure": 0.0}, 0.5)
    assert not bad["rl_starts"] and "basic layer" in bad["reason"] and "62%" in bad["reason"]
    assert gate_decision({"interface": 0.0, "basic": 0.0, "sequential": 0.0, "infrastructure": 0.0}, 0.5)["rl_starts"]


def test_copy_probe_batches_score_only_tokens_that_a_copy_can_give():
    """Every scored token of each probe task stands earlier in its row: a copy can give it."""
    import numpy as np

    from experiments.binary_search_rl.copy_probe import TASKS, run

    for name, make in TASKS.items():
        ids, mask = make(np.random.default_rng(0))
        assert ids.shape == mask.shape and mask.sum() > 0, name
        for row, m in zip(ids, mask):
            for t in np.flatnonzero(m):
                assert row[t] in row[:t - 1], (name, t)
    # compiles and steps (figures every 100 steps), then scores the untrained task
    assert run("keyed", steps=2, lr=1e-3, then=("repeat",)) == []


@pytest.mark.slow
def test_pretrain_check_diagnoses_the_drilled_base_and_the_copy_only_model(tmp_path, capsys):
    """The pretraining stage alone, then the teacher-forced diagnostic of both its models."""
    from experiments.binary_search_rl.pretrain_check import main as check_main

    tiny = [a for a in TINY if a.startswith(("--model.", "--pretrain."))]
    assert check_main(tiny + ["--pretrain.copy_batch_size=2", "--diagnose.tasks=2", f"--work_dir={tmp_path}"]) == 0
    out = json.loads((tmp_path / "pretrain_check.json").read_text())
    assert set(out["diagnostics"]["per_policy"]) == {"pretrain", "copy_only"}
    assert out["config"]["pretrain"]["copy_steps"] == 2 and "copy_nll_last_50" in out
    assert "drilled base" in capsys.readouterr().out
    # another drill setting and tool style: the copy stage is reused, the drills are not
    copy_weights = tmp_path / "pretrain_copy" / "policy" / "model.safetensors"
    drill_weights = tmp_path / "pretrain" / "policy" / "model.safetensors"
    before = (copy_weights.stat().st_mtime_ns, drill_weights.stat().st_mtime_ns)
    assert check_main(tiny + ["--pretrain.copy_batch_size=2", "--diagnose.tasks=2", "--tool_style=lines",
                              f"--work_dir={tmp_path}"]) == 0
    assert copy_weights.stat().st_mtime_ns == before[0] and drill_weights.stat().st_mtime_ns != before[1]
    out = json.loads((tmp_path / "pretrain_check.json").read_text())
    assert "str_replace" in out["diagnostics"]["per_policy"]["pretrain"]
    with pytest.raises(ValueError, match="no pretraining stage"):
        check_main(["--pretrain.steps=0", f"--work_dir={tmp_path}"])


def test_drill_change_edits_leave_their_random_line_out_of_the_loss():
    """mask_changes: the change edits' line numbers (drawn at random) leave the loss; their
    copied text, the restores and the fix edits' numbers stay in it."""
    from experiments.binary_search_rl.drills import make_drills, mask_change_addresses
    from experiments.binary_search_rl.edits import edit_parts, policy_turns
    from jaxrl_agent.env.tasks import generate_tasks, workspace_files
    from jaxrl_agent.tokenizer import ChatFormat, load_tokenizer

    chat = ChatFormat(load_tokenizer(), tool_style="short")
    tasks = generate_tasks("train", 3, 5)
    plain = make_drills(tasks, chat, seed=0, extra_edits=2)
    masked = make_drills(tasks, chat, seed=0, extra_edits=2, mask_changes=True)
    dropped_total = 0
    for task, a, b in zip(tasks, plain, masked):
        assert a.ids == b.ids
        dropped = [t for t in range(len(a.ids)) if a.loss_mask[t] and not b.loss_mask[t]]
        assert all(b.loss_mask[t] <= a.loss_mask[t] for t in range(len(a.ids)))
        turns = sorted({a.turn_id[t] for t in dropped})
        dropped_total += len(dropped)
        for tid in turns:  # only line-number tokens of whole change turns, "N, "end": N" apart
            pos = [t for t in range(len(a.ids)) if a.loss_mask[t] and a.turn_id[t] == tid]
            kinds = edit_parts([a.ids[p] for p in pos], chat.tokenizer.decode, workspace_files(task))
            assert {p for p, k in zip(pos, kinds) if k == "lines"} == {t for t in dropped if a.turn_id[t] == tid}
        # the last edit before submit is a fix: its numbers stay
        last_edit = a.turn_id[policy_turns(a.loss_mask, a.turn_id)[-2][0]]
        assert '"start"' in chat.tokenizer.decode([a.ids[p] for p in policy_turns(a.loss_mask, a.turn_id)[-2]])
        assert last_edit not in turns
    assert dropped_total > 0
    with pytest.raises(ValueError, match="not an edit call"):
        mask_change_addresses(plain[0], [0], chat.tokenizer.decode, workspace_files(tasks[0]))  # turn 0 reads


def test_behaviour_series_counts_either_styles_edits():
    from experiments.binary_search_rl.stages import behaviour_series

    m = {"rollout/tool_calls_per_episode/replace_lines": 1.5, "rollout/terminations/submitted": 0.75,
         "rollout/tool_calls_per_episode/read_file": 2.0}
    got = behaviour_series(m)
    assert got["edits"] == 1.5 and got["submitted"] == 0.75 and got["tool_errors"] == 0.0
    assert behaviour_series({**m, "rollout/tool_calls_per_episode/str_replace": 0.5})["edits"] == 2.0


def test_sft_and_drill_stages_hand_their_group_by_length_to_run_sft(tmp_path, monkeypatch):
    from dataclasses import replace

    from experiments.binary_search_rl import stages
    from jaxrl_agent.trajectory import Episode

    seen = []

    class Stop(Exception):
        pass

    def fake_run_sft(model, data, **kw):  # records what the stage asked for, trains nothing
        seen.append(kw["group_by_length"])
        raise Stop

    monkeypatch.setattr(stages, "run_sft", fake_run_sft)
    cfg = StudyConfig(work_dir=str(tmp_path))
    cfg = replace(cfg, sft=replace(cfg.sft, group_by_length=5),
                  pretrain=replace(cfg.pretrain, group_by_length=3, num_tasks=2, copy_steps=0),
                  model=replace(cfg.model, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                                intermediate_size=64))
    ep = Episode(ids=[1, 2, 3], loss_mask=[0, 1, 1], sampler_logp=[0.0] * 3, turn_id=[0] * 3, reward=1.0)
    with pytest.raises(Stop):
        stages.sft(cfg, "sft", [ep], {}, None, success_only=False)
    with pytest.raises(Stop):
        stages.pretrain(cfg)
    assert seen == [5, 3]


def test_diagnostics_command_names_its_expected_arguments():
    from experiments.binary_search_rl.diagnostics import main as diagnose

    with pytest.raises(SystemExit):
        diagnose(["experiments/binary_search_rl/results/policies/sft"])  # no name=
