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

import rl_worker
from jaxrl_agent.chat_template import IM_END
from jaxrl_agent.config import OptimConfig, RLConfig, TrainConfig
from jaxrl_agent.loops.rl import NoSignalError, train_rl
from jaxrl_agent.model.decoder import CausalLM, ModelConfig
from jaxrl_agent.tokenizer import load_tokenizer
from jaxrl_agent.trajectory import Episode, load_episodes
from rl_worker import configs, sft_policy

pytestmark = pytest.mark.slow

TASKS, TOOLS, ROLLOUT, SAMPLING, TRAJ = configs()


def rl_config(tmp_path, **kw) -> RLConfig:
    return rl_worker.rl_config(str(tmp_path / "run"), **kw)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def sft_model(tok):
    return sft_policy(tok)


def test_grpo_learns_the_rewarded_call(sft_model, tok, tmp_path):
    # Adam moves every weight by ~lr per step whatever the gradient's size: for a 60k-parameter
    # model 1e-3 is a large step, taken on 32 episodes per update. An iteration's success is a
    # mean over 32 episodes (sd ~0.09), so the trend is the second half's mean against the first
    # two iterations' (sd of that difference ~0.075: a no-signal run rarely clears 0.15).
    res = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=8, tasks_per_iter=4, algo="grpo"), rollout=ROLLOUT,
                   sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3), tools=TOOLS,
                   traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:2], show_progress=False)
    succ = [it["rollout/success"] for it in res["iterations"]]
    assert 0.05 < res["probe"]["pass1"] < 0.9, "the SFT start should explore both calls"
    # this task ships correct code, so the "buggy" files pass too: the check must say so
    assert res["verifier_check"] == {"reference_scores_1": 1.0, "buggy_scores_0": 0.0, "n": 2}
    assert res["repeatable"]
    assert np.mean(succ[4:]) > np.mean(succ[:2]) + 0.15, succ
    assert res["after"]["pass1"] > res["before"]["pass1"] + 0.2
    # metrics reached JSONL, and the final policy was exported
    run_dir = rl_config(tmp_path).run_dir
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert any("train/loss" in x for x in lines) and os.path.exists(os.path.join(run_dir, "policy"))
    # a group's episodes verify the same untouched code: one execution serves them (rl.sandbox_memo)
    last = res["iterations"][-1]
    assert last["sandbox/calls_shared"] > 0 and last["sandbox/calls_run"] > 0


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


def test_keep_best_exports_the_best_evaluated_policy_and_survives_a_resume(sft_model, tok, tmp_path, monkeypatch):
    """rl.keep_best: the policy of the best evaluation after training began (ties: the later)
    is `<run_dir>/best_policy`; a resumed run still knows the best from before its stop."""
    import jaxrl_agent.loops.rl as rl_mod
    from jaxrl_agent import hf

    real, scripted = rl_mod.evaluate, {}

    def scored(*a, description="", **k):  # the real evaluation, with the pass@1 this test chooses
        summary, eps = real(*a, description=description, **k)
        return ({**summary, "pass1": scripted[description]} if description in scripted else summary), eps
    monkeypatch.setattr(rl_mod, "evaluate", scored)
    kw = dict(rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3),
              tools=TOOLS, traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:1], show_progress=False)
    run_dir = rl_config(tmp_path).run_dir
    weights = lambda name: jax.tree.leaves(nnx.state(hf.load_pretrained(os.path.join(run_dir, name))[0], nnx.Param))
    scripted.update({"eval before": 1.0, "eval @ 1": 0.5, "eval @ 2": 0.9, "eval after": 0.9})
    first = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=3, eval_every=1, keep_best=True), **kw)
    assert first["best"] == {"iteration": 3, "pass1": 0.9, "policy": os.path.join(run_dir, "best_policy")}
    for a, b in zip(weights("best_policy"), weights("policy")):  # iteration 3 is the final policy
        np.testing.assert_array_equal(a, b)
    scripted.update({"eval after": 0.7})
    resumed = train_rl(sft_model, tok, rl=rl_config(tmp_path, iterations=4, eval_every=1, keep_best=True),
                       resume=True, **kw)
    assert resumed["best"]["iteration"] == 3  # restored from the checkpoint, not beaten by 0.7
    assert any(not np.array_equal(a, b) for a, b in zip(weights("best_policy"), weights("policy")))


@pytest.mark.parametrize("before_eval", ["start", "end"])
def test_no_signal_refuses_to_train(tok, tmp_path, before_eval):
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    with pytest.raises(NoSignalError, match="no signal") as err:
        train_rl(CausalLM(cfg, rngs=nnx.Rngs(1)), tok, rl=rl_config(tmp_path, before_eval=before_eval),
                 rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(), tools=TOOLS, traj=TRAJ,
                 train_tasks=TASKS, eval_tasks=TASKS[:1], show_progress=False)
    # the verdict carries the starting policy's held-out evaluation whenever that would have run
    assert err.value.result["before"]["n_episodes"] == 4 and err.value.result["probe"]["pass1"] == 0.0


def test_the_probe_is_iteration_one_and_the_before_eval_can_run_last(sft_model, tok, tmp_path, monkeypatch):
    """Iteration 1 trains on the probe's episodes (the starting policy is sampled once for
    both), and rl.before_eval="end" evaluates the kept starting policy after training: the
    same episodes, so the same summary, as "start"."""
    import jaxrl_agent.loops.evaluate as eval_mod
    import jaxrl_agent.loops.rl as rl_mod

    real, calls = rl_mod.collect_share, []

    def counted(*a, **k):
        eps, stats = real(*a, **k)
        calls.append(len(eps))
        return eps, stats
    monkeypatch.setattr(rl_mod, "collect_share", counted)  # training batches
    monkeypatch.setattr(eval_mod, "collect_share", counted)  # evaluations
    kw = dict(rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3),
              tools=TOOLS, traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:2], show_progress=False)
    runs = {}
    for when in ("start", "end"):
        calls.clear()
        runs[when] = train_rl(sft_model, tok, rl=rl_config(tmp_path / when, iterations=2, before_eval=when), **kw)
        rollout, ev = 2 * ROLLOUT.group_size, 2 * 4  # tasks_per_iter x group; eval tasks x samples
        # probe = iteration 1, then the evaluations around iteration 2 in the order asked for
        assert calls == [rollout, ev, rollout, ev] if when == "start" else [rollout, rollout, ev, ev], calls
    start, end = runs["start"], runs["end"]
    assert {k: v for k, v in start["before"].items() if k != "cost"} == {
        k: v for k, v in end["before"].items() if k != "cost"}
    assert start["probe"] == end["probe"] and start["repeatable"] and end["repeatable"]
    for a, b in zip(start["iterations"], end["iterations"]):  # the same training
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    # the probe's figures are iteration 1's batch
    assert start["probe"]["pass1"] == pytest.approx(start["iterations"][0]["rollout/success"])
    lines = [json.loads(x) for x in open(tmp_path / "end" / "run" / "metrics.jsonl")]
    assert any("eval_before/pass1" in x for x in lines) and not any("eval/pass1" in x for x in lines)
    with pytest.raises(ValueError, match="before_eval"):
        train_rl(sft_model, tok, rl=rl_config(tmp_path / "bad", before_eval="middle"), **kw)


def test_the_top_bucket_compiles_when_the_first_rollout_needs_it(sft_model, tok, tmp_path, monkeypatch):
    """rl.precompile: the smaller length buckets are compiled at once; the top one (the slowest)
    is queued during iteration 1's rollout as soon as one of its episodes needs it, else once
    iteration 1 is done (it then overlaps later rollouts, not the first one)."""
    import jaxrl_agent.loops.evaluate as eval_mod
    import jaxrl_agent.loops.rl as rl_mod
    from jaxrl_agent.config import TrajectoryConfig
    from jaxrl_agent.train.step import TrainStep

    rollouts, asked, inside = [], [], []
    real = rl_mod.collect_share

    def counted(*a, **k):
        rollouts.append(1)
        inside.append(1)
        try:
            return real(*a, **k)
        finally:
            inside.pop()
    monkeypatch.setattr(rl_mod, "collect_share", counted)  # training batches
    monkeypatch.setattr(eval_mod, "collect_share", counted)  # evaluations
    monkeypatch.setattr(TrainStep, "precompile", lambda self, batches: asked.append(
        ([b.tokens.shape[1] for b in batches], len(rollouts), bool(inside))))
    kw = dict(rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3),
              tools=TOOLS, train_tasks=TASKS, eval_tasks=TASKS[:2], show_progress=False)
    for buckets in ((64, 128, 256), (128, 256, 512)):
        asked.clear()
        rollouts.clear()
        res = train_rl(sft_model, tok, rl=rl_config(tmp_path / str(buckets[0]), iterations=2, before_eval="end"),
                       traj=TrajectoryConfig(buckets=buckets), **kw)
        assert "train/loss" in res["iterations"][0]  # iteration 1 trained
        assert res["iterations"][0]["rollout/mean_tokens"] > 128
        assert asked[0] == (list(buckets[:2]), 0, False), asked
        if buckets[1] < 256:  # this task's episodes are longer than 128 tokens: needed in rollout 1
            assert asked[1:] == [([buckets[2]], 1, True)], asked
        else:  # none is longer than 256 (the token budget): queued before iteration 2's rollout
            assert asked[1:] == [([buckets[2]], 1, False)], asked


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
    from jaxrl_agent.agent.policy import PolicyConfig, load_policy
    from jaxrl_agent.cli.eval import EvalConfig, EvalRunConfig, run_eval_job
    from jaxrl_agent.cli.export import ExportConfig, ExportRunConfig, run_export_job
    from jaxrl_agent.env.tasks import binary_search_task, save_tasks

    policy = str(tmp_path / "policy")
    hf.save_pretrained(sft_model, sft_model.config, policy)
    task_file = str(tmp_path / "tasks.jsonl")
    save_tasks(task_file, [binary_search_task()])
    out = str(tmp_path / "eval.json")
    summary = run_eval_job(EvalRunConfig(policy=PolicyConfig(policy), eval=EvalConfig(task_file=task_file, samples=2, out=out),
                                         rollout=ROLLOUT, sampling=SAMPLING, tools=TOOLS), show_progress=False)
    saved = json.load(open(out))
    assert saved["n_episodes"] == 2 and saved["split"] == task_file and 0.0 <= summary["pass1"] <= 1.0
    logged = load_episodes(str(tmp_path / "eval.episodes.jsonl"))  # the episode file, every episode whole
    assert len(logged) == 2 and {e.info["task_id"] for e in logged} == {"binary_search"}
    assert sum(e.reward for e in logged) / 2 == pytest.approx(summary["pass1"]) and all(sum(e.loss_mask) for e in logged)
    # A failure after the episodes ran keeps them: a partial summary names the error.
    import jaxrl_agent.loops.evaluate as eval_mod

    def broken(*a, **k):
        raise RuntimeError("late failure")
    monkeypatch.setattr(eval_mod, "summarize_episodes", broken)
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
    from jaxrl_agent.agent.evaluation import render_trajectory

    prompt, reply, obs = tok.encode("<|im_start|>user\nfix it"), tok.encode("<tool_call>"), tok.encode("ok")
    ep = Episode(prompt + reply + obs, [0] * len(prompt) + [1] * len(reply) + [0] * len(obs),
                 [0.0] * (len(prompt) + len(reply) + len(obs)), [0] * (len(prompt) + len(reply) + len(obs)))
    text = render_trajectory(ep, tok)
    styled = {(text.plain[s.start:s.end], str(s.style)) for s in text.spans}
    assert ("<tool_call>", "bold green") in styled and ("ok", "dim") in styled
    assert text.plain == tok.decode(ep.ids)


def test_one_step_off_policy_rollouts(sft_model, tok, tmp_path):
    """`max_staleness=1`: iteration k+1's rollouts run on the policy before update k. With a
    zero learning rate the policy never changes, so the overlapped loop must sample exactly
    the synchronous loop's episodes (same tasks, seeds and order); with a real one, episodes
    after the first iteration are one update old and the IS correction reports on them."""
    kw = dict(rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), tools=TOOLS, traj=TRAJ, train_tasks=TASKS,
              eval_tasks=TASKS[:1], show_progress=False)
    runs = {}
    for name, stale, lr in (("sync", 0, 0.0), ("stale", 1, 0.0), ("stale_lr", 1, 5e-3)):
        runs[name] = train_rl(sft_model, tok, rl=rl_config(tmp_path / name, iterations=3, max_staleness=stale),
                              optim=OptimConfig(learning_rate=lr), **kw)
    sync, stale, moving = (runs[k]["iterations"] for k in ("sync", "stale", "stale_lr"))
    for a, b in zip(sync, stale):
        for key in ("rollout/reward_mean", "rollout/mean_tokens", "rollout/tool_calls_per_episode/submit"):
            assert a.get(key) == b.get(key), key
    assert [it["rollout/staleness_max"] for it in sync] == [0, 0, 0]
    assert [it["rollout/staleness_max"] for it in stale] == [0, 1, 1]
    assert [it["rollout/staleness_max"] for it in moving] == [0, 1, 1]
    for a, b in zip(jax.tree.leaves(runs["sync"]["train_step"].policy_params(runs["sync"]["state"])),
                    jax.tree.leaves(runs["stale"]["train_step"].policy_params(runs["stale"]["state"]))):
        np.testing.assert_array_equal(a, b)
    assert "train/tis_weight_mean" in moving[0] and "train/tis_weight_mean" not in sync[0]  # cap 2.0 by default
    assert moving[0]["train/logp_gap_max"] < 1e-3  # the first batch is on-policy ...
    assert min(it["train/logp_gap_mean"] for it in moving[1:]) > 10 * moving[0]["train/logp_gap_mean"]  # ... later ones lag
    assert all(np.isfinite(it["train/tis_weight_mean"]) and it["train/tis_weight_mean"] > 0 for it in moving)
    assert moving[-1]["time/rollout_wait"] >= 0.0  # the update's wait for the overlapped rollout is timed
    assert 0 < sync[0]["time/compile"] <= sync[-1]["time/compile"]  # JAX's compile seconds so far, logged
    with pytest.raises(ValueError, match="max_staleness=2"):
        train_rl(sft_model, tok, rl=rl_config(tmp_path / "bad", max_staleness=2), optim=OptimConfig(), **kw)
