"""The RL loop end to end on a one-step tool-choice task: a tiny LM, SFT'd on a 50/50 mix of
`submit` and `list_files` demonstrations, must learn that only `submit` is rewarded (the update
direction is right, not only that it runs); every algorithm runs through the same loop with
its invariants checked; a killed run resumes from its checkpoint."""
import json
import os
from dataclasses import replace

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_agent.config import (SYSTEM_PROMPT, OptimConfig, RLConfig, RolloutConfig, SamplingConfig, TrainConfig,
                                TrajectoryConfig)
from jaxrl_agent.env.tasks import Task
from jaxrl_agent.env.tools import ToolConfig, format_tool_call
from jaxrl_agent.model import CausalLM, ModelConfig
from jaxrl_agent.offline import run_sft
from jaxrl_agent.rl import NoSignalError, policy_for_engine, train_rl
from jaxrl_agent.rollout import episode_prompt
from jaxrl_agent.tokenizer import IM_END, ChatFormat, EpisodeBuilder, load_tokenizer
from jaxrl_agent.trajectory import Episode

pytestmark = pytest.mark.slow

SOURCE = "def answer():\n    return 42\n"
TEST = "from answer import answer\n\n\ndef test_answer():\n    assert answer() == 42\n"


def submit_task(i: int) -> Task:
    """Already correct: submitting it earns 1; any other first call ends the episode with 0."""
    return Task(task_id=f"submit-{i}", instruction="The repository is already correct. Submit it.",
                files={"answer.py": SOURCE}, dev_tests={"test_answer.py": TEST},
                hidden_tests={"test_hidden_answer.py": TEST}, reference_files={"answer.py": SOURCE},
                metadata={"template": "submit_only", "split": "custom"})


TASKS = [submit_task(i) for i in range(4)]
TOOLS = ToolConfig(max_turns=1)
ROLLOUT = RolloutConfig(group_size=8, max_total_tokens=256, max_tokens_per_turn=32)
SAMPLING = SamplingConfig(max_new_tokens=32, batch_size=16, cache_size=256, prefill_buckets=(256,))
TRAJ = TrajectoryConfig(buckets=(256,))


def rl_config(tmp_path, **kw) -> RLConfig:
    base = dict(iterations=2, tasks_per_iter=2, eval_tasks=2, eval_samples=4, eval_every=0, num_train_tasks=4,
                run_dir=str(tmp_path / "run"), checkpoint_every=1, sandbox_workers=2)
    return RLConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def sft_model(tok):
    """A tiny policy that calls `submit` about half the time and `list_files` otherwise."""
    chat = ChatFormat(tok, tool_style="short")
    demos = []
    for i, name in enumerate(["submit", "list_files"] * 8):
        b = EpisodeBuilder(chat, episode_prompt(TASKS[i % 4], SYSTEM_PROMPT), chat.tool_schemas)
        ids = tok.encode(format_tool_call(name, {}) + IM_END)
        b.append_sampled(ids, [0.0] * len(ids))
        demos.append(Episode.from_builder(b, termination="submitted"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True,
                      architecture="Qwen2ForCausalLM")
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    state, hist, ts = run_sft(model, demos, train_cfg=TrainConfig(), optim_cfg=OptimConfig(learning_rate=1e-2),
                              traj_cfg=TRAJ, num_steps=60, batch_size=16)
    assert hist[-1]["loss"] < 0.1 * hist[0]["loss"]
    return policy_for_engine(ts, state)


def test_grpo_learns_the_rewarded_call(sft_model, tok, tmp_path):
    # Adam moves every weight by ~lr per step whatever the gradient's size: for a 60k-parameter
    # model 1e-3 is already a large step, so a moderate rate and 32 episodes per update.
    res = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=8, tasks_per_iter=4, algo="grpo"), rollout=ROLLOUT,
                   sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=5e-4), tools=TOOLS,
                   traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:2], show_progress=False)
    succ = [it["rollout/success"] for it in res["iterations"]]
    assert 0.05 < res["probe"]["pass1"] < 0.9, "the SFT start should explore both calls"
    # this task ships correct code, so the "buggy" files pass too: the check must say so
    assert res["verifier_check"] == {"reference_scores_1": 1.0, "buggy_scores_0": 0.0, "n": 2}
    assert res["repeatable"]
    assert np.mean(succ[-3:]) > np.mean(succ[:2]) + 0.2, succ
    assert res["after"]["pass1"] > res["before"]["pass1"] + 0.2
    # metrics reached JSONL, and the final policy was exported
    run_dir = rl_config(tmp_path).run_dir
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert any("train/loss" in x for x in lines) and os.path.exists(os.path.join(run_dir, "policy"))


@pytest.mark.parametrize("algo", ["dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo"])
def test_every_algorithm_runs_the_loop(sft_model, tok, tmp_path, algo):
    train = TrainConfig(use_ref=True, loss=replace(TrainConfig().loss, kl_coef=0.01))
    res = train_rl(sft_model, tok, rl=rl_config(tmp_path, algo=algo), rollout=ROLLOUT, sampling=SAMPLING,
                   train=train, optim=OptimConfig(learning_rate=1e-3), tools=TOOLS, traj=TRAJ, train_tasks=TASKS,
                   eval_tasks=TASKS[:1], show_progress=False)
    before = jax.tree.leaves(nnx.state(sft_model, nnx.Param))
    after = jax.tree.leaves(res["train_step"].policy_params(res["state"]))
    assert len(res["iterations"]) == 2
    for it in res["iterations"]:
        assert np.isfinite(it["train/loss"]) and it["train/policy_tokens"] > 0
        assert it["train/logp_gap_max"] < 1e-3  # sampler and trainer agree on the policy tokens
        assert 0.0 <= it["rollout/reward_mean"] <= 1.0
    assert any(not np.allclose(a, b) for a, b in zip(before, after)), "parameters did not change"


def test_shuffled_reward_control_runs_every_iteration(sft_model, tok, tmp_path):
    """The control of the study (rewards permuted within the batch) runs past its first
    iteration: it once died on iteration 2 because the permuted list shadowed the reward config."""
    res = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=3, shuffle_rewards=True), rollout=ROLLOUT,
                   sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3), tools=TOOLS,
                   traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:2], show_progress=False)
    assert len(res["iterations"]) == 3 and "after" in res


def test_resume_continues_from_checkpoint(sft_model, tok, tmp_path):
    kw = dict(rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3),
              tools=TOOLS, traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:1], show_progress=False)
    first = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=1), **kw)
    resumed = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=2), resume=True, **kw)
    assert len(resumed["iterations"]) == 1 and "before" not in resumed  # only the missing iteration ran
    assert int(resumed["state"].step) == 2 and int(first["state"].step) == 1


def test_no_signal_refuses_to_train(tok, tmp_path):
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    with pytest.raises(NoSignalError, match="no signal"):
        train_rl(CausalLM(cfg, rngs=nnx.Rngs(1)), tok, rl=rl_config(tmp_path), rollout=ROLLOUT, sampling=SAMPLING,
                 train=TrainConfig(), optim=OptimConfig(), tools=TOOLS, traj=TRAJ, train_tasks=TASKS,
                 eval_tasks=TASKS[:1], show_progress=False)


def test_too_few_training_tasks_is_a_clear_error(sft_model, tok, tmp_path):
    with pytest.raises(ValueError, match="tasks_per_iter=5 must be in \\[1, 4\\]"):
        train_rl(sft_model, tok, rl=rl_config(tmp_path, tasks_per_iter=5), rollout=ROLLOUT, sampling=SAMPLING,
                 train=TrainConfig(), optim=OptimConfig(), tools=TOOLS, traj=TRAJ, train_tasks=TASKS,
                 eval_tasks=TASKS[:1], show_progress=False)
    # rollout batches carry no reference log-probs: a KL weight without use_ref would train without KL
    with pytest.raises(ValueError, match="use_ref=true"):
        train_rl(sft_model, tok, rl=rl_config(tmp_path), rollout=ROLLOUT, sampling=SAMPLING,
                 train=TrainConfig(loss=replace(TrainConfig().loss, kl_coef=0.1)), optim=OptimConfig(), tools=TOOLS,
                 traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:1], show_progress=False)


def test_eval_and_export_commands(sft_model, tok, tmp_path, monkeypatch):
    """The CLI's eval and export jobs on a saved tiny policy and a short run's checkpoint; the
    eval job and the run's held-out evaluation read their tasks from a JSONL task file."""
    from jaxrl_agent import hf
    from jaxrl_agent.env.tasks import binary_search_task, save_tasks
    from jaxrl_agent.pipelines import (EvalConfig, EvalRunConfig, ExportConfig, ExportRunConfig, PolicyConfig,
                                       load_policy, run_eval_job, run_export_job)

    policy = str(tmp_path / "policy")
    hf.save_pretrained(sft_model, sft_model.config, policy)
    task_file = str(tmp_path / "tasks.jsonl")
    save_tasks(task_file, [binary_search_task()])
    out = str(tmp_path / "eval.json")
    summary = run_eval_job(EvalRunConfig(policy=PolicyConfig(policy), eval=EvalConfig(task_file=task_file, samples=2, out=out),
                                         rollout=ROLLOUT, sampling=SAMPLING, tools=TOOLS), show_progress=False)
    saved = json.load(open(out))
    assert saved["n_episodes"] == 2 and saved["split"] == task_file and 0.0 <= summary["pass1"] <= 1.0
    lines = [json.loads(x) for x in open(str(tmp_path / "eval.episodes.jsonl"))]
    assert len(lines) == 2 and {x["task_id"] for x in lines} == {"binary_search"}
    # A failure after the episodes ran keeps them: a partial summary names the error.
    import jaxrl_agent.rl as rl_mod

    def broken(*a, **k):
        raise RuntimeError("late failure")
    monkeypatch.setattr(rl_mod, "summarize_episodes", broken)
    with pytest.raises(RuntimeError, match="late failure"):
        run_eval_job(EvalRunConfig(policy=PolicyConfig(policy), eval=EvalConfig(task_file=task_file, samples=2, out=out),
                                   rollout=ROLLOUT, sampling=SAMPLING, tools=TOOLS), show_progress=False)
    partial = json.load(open(out))
    assert partial["partial"] and partial["n_episodes"] == 2 and "late failure" in partial["error"]
    monkeypatch.undo()
    run_dir = str(tmp_path / "run")
    res = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=1, eval_file=task_file, eval_samples=1),
                   rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3),
                   tools=TOOLS, traj=TRAJ, train_tasks=TASKS, show_progress=False)
    assert res["before"]["n_tasks"] == 1 and res["before"]["n_episodes"] == 1  # the file's one task
    exported = str(tmp_path / "exported")
    run_export_job(ExportRunConfig(policy=PolicyConfig(policy), export=ExportConfig(run_dir=run_dir, out=exported),
                                   optim=OptimConfig(learning_rate=1e-3)), show_progress=False)
    model, _ = hf.load_pretrained(exported)
    for d in (exported, os.path.join(run_dir, "policy")):  # both exports carry the run's tokenizer
        assert os.path.exists(os.path.join(d, "tokenizer.json")) and load_policy(d)[1].encode(IM_END) == tok.encode(IM_END)
    trained = hf.load_pretrained(os.path.join(run_dir, "policy"))[0]
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(trained, nnx.Param))):
        np.testing.assert_array_equal(a, b)  # the checkpoint export == the run's own final export


def test_render_trajectory_marks_policy_and_masked_tokens(tok):
    from jaxrl_agent.pipelines import render_trajectory

    prompt, reply, obs = tok.encode("<|im_start|>user\nfix it"), tok.encode("<tool_call>"), tok.encode("ok")
    ep = Episode(prompt + reply + obs, [0] * len(prompt) + [1] * len(reply) + [0] * len(obs),
                 [0.0] * (len(prompt) + len(reply) + len(obs)), [0] * (len(prompt) + len(reply) + len(obs)))
    text = render_trajectory(ep, tok)
    styled = {(text.plain[s.start:s.end], str(s.style)) for s in text.spans}
    assert ("<tool_call>", "bold green") in styled and ("ok", "dim") in styled
    assert text.plain == tok.decode(ep.ids)
