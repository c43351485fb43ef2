"""The study command (experiments/binary_search_rl) end to end on a tiny setting: every stage
runs, the summary has the keys the issue names, plots and trajectories are written, and a
second invocation reuses the finished stages instead of recomputing them."""
import json
import os

import pytest

from experiments.binary_search_rl.__main__ import main
from experiments.binary_search_rl.report import POLICIES

TINY = ["--demos.num_tasks=3", "--sft.steps=2", "--sft.batch_size=2", "--rl.iterations=1", "--rl.tasks_per_iter=1",
        "--rl.group_size=2", "--rl.num_train_tasks=2", "--rl.eval_every=1", "--rl.curve_tasks=1",
        "--rl.require_signal=false", "--eval.canonical_samples=2", "--eval.heldout_instance_tasks=1",
        "--eval.heldout_template_tasks=1", "--eval.samples_per_task=1", "--model.num_layers=1",
        "--model.hidden_size=32", "--model.num_heads=2", "--model.num_kv_heads=1", "--model.intermediate_size=64"]


@pytest.mark.slow
def test_study_runs_every_stage_and_writes_the_summary(tmp_path, capsys):
    args = TINY + [f"--work_dir={tmp_path / 'work'}", f"--results_dir={tmp_path / 'results'}"]
    assert main(args) == 0
    res = tmp_path / "results"
    summary = json.loads((res / "summary.json").read_text())
    for split in ("canonical", "heldout_instances", "heldout_templates"):
        for pol in POLICIES:
            e = summary[split][pol]
            assert 0.0 <= e["ci_low"] <= e["pass1"] <= e["ci_high"] <= 1.0
    assert summary["canonical"]["sft"]["n_episodes"] == 2
    assert summary["config"]["sft"]["steps"] == 2 and len(summary["git_commit"]) >= 7
    assert set(summary["targets"]) >= {"canonical_rl_pass1_at_least_0.95", "control_gain_at_most_0.05"}
    for name in ("training_curves.png", "final_comparison.png", "trajectory_before_rl.html",
                 "trajectory_after_rl.md", "results.md"):
        assert (res / name).stat().st_size > 0, name
    md = (res / "trajectory_after_rl.md").read_text()
    assert "\n▶ " in md                        # policy tokens are marked
    assert "│ <|im_start|>system" in md           # the prompt is masked
    # the control really permuted rewards and both runs logged iteration metrics
    assert summary["training"]["rl"]["train_reward"] and summary["training"]["control"]["train_reward"]
    capsys.readouterr()
    # second invocation: every stage comes from the work dir (no SFT step is printed again)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[sft] step" not in out and "[rl] iter" not in out
    assert os.path.exists(tmp_path / "work" / "sft" / "policy" / "model.safetensors")


def test_study_rejects_a_bad_override():
    with pytest.raises(SystemExit):
        main(["--sft.nonexistent=3"])
