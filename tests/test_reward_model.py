"""Tests for the reward model (agent/ and loops/reward_model.py) and the Bradley-Terry loss: the kernel against a NumPy loop, the
LossFn reading the scalar head at the last policy token, `rm-train` learning to rank held-out
pairs of a synthetic preference set, frozen scoring == the training path, export / load, the
reward model staying bit-identical through policy updates, and an RL run on
verifier + reward model that logs both."""
import json
import os
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import trainer_worker as tw
from jaxrl_agent import hf
from jaxrl_agent import losses as L
from jaxrl_agent.agent.preference_pairs import pair_batch, save_preference_pairs
from jaxrl_agent.agent.reward_model import META_FILE, RewardModel, load_reward_model, with_scalar_head
from jaxrl_agent.cli import main as cli
from jaxrl_agent.config import LossConfig, OptimConfig, RewardConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.losses.registry import LOSSES, REWARD_MODEL_LOSSES, reward_scores
from jaxrl_agent.structs import PolicyOutputs
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.trajectory import Episode, collate

HELD_OUT_ACCURACY = 0.9  # chance is 0.5; the rule below is learnable from 120 pairs


# ---- the kernel against a NumPy loop ----
def np_bradley_terry(chosen, rejected, margin, eps, weights):
    """Loss and d loss / d chosen, pair by pair."""
    n = max(weights.sum(), 1.0)
    loss, grad = 0.0, np.zeros(len(chosen))
    for i, (c, r, m, w) in enumerate(zip(chosen, rejected, margin, weights)):
        x = c - r - m
        sig = 1.0 / (1.0 + np.exp(-x))
        loss += w * (-(1 - eps) * np.log(sig) - eps * np.log(1.0 - sig)) / n
        grad[i] = w * (-(1 - eps) * (1.0 - sig) + eps * sig) / n
    return loss, grad


@pytest.mark.parametrize("margin,eps", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.1), (1.0, 0.2)])
def test_bradley_terry_matches_numpy_reference(margin, eps):
    rng = np.random.default_rng(0)
    c, r = rng.normal(size=9).astype(np.float32), rng.normal(size=9).astype(np.float32)
    r[3] = c[3]  # a tie
    w = np.ones(9, np.float32)
    w[-2:] = 0.0  # two padding pairs
    m = np.full(9, margin)

    def f(c_):
        return L.bradley_terry_loss(c_, jnp.asarray(r), margin=margin, label_smoothing=eps, weights=jnp.asarray(w))

    (loss, metrics), g = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(c))
    want, want_g = np_bradley_terry(c, r, m, eps, w)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-7)
    d = (c - r)[:7]
    assert float(metrics["rm_accuracy"]) == pytest.approx(((d > 0).sum() + 0.5 * (d == 0).sum()) / 7)
    assert float(metrics["rm_margin"]) == pytest.approx(d.mean(), rel=1e-5)
    # per-pair margins, and equal scores give log 2 and accuracy 1/2
    per, _ = L.bradley_terry_loss(jnp.asarray(c), jnp.asarray(r), margin=jnp.asarray(m))
    np.testing.assert_allclose(per, np_bradley_terry(c, r, m, 0.0, np.ones(9))[0], rtol=1e-5)
    loss0, m0 = L.bradley_terry_loss(jnp.zeros(4), jnp.zeros(4))
    assert float(loss0) == pytest.approx(np.log(2.0)) and float(m0["rm_accuracy"]) == 0.5
    with pytest.raises(ValueError, match="two \\[P\\] arrays"):
        L.bradley_terry_loss(jnp.zeros((2, 2)), jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match="label_smoothing"):
        L.bradley_terry_loss(jnp.zeros(2), jnp.zeros(2), label_smoothing=0.5)


# ---- synthetic preference set ----
def synthetic_episode(rng, marker: int) -> Episode:
    """A random prompt and response; the response holds `marker` somewhere before its stop id."""
    p, n = int(rng.integers(3, 8)), int(rng.integers(6, 20))
    resp = rng.integers(10, 100, n)
    resp[int(rng.integers(0, n))] = marker
    ids = [int(i) for i in (*rng.integers(10, 100, p), *resp, 2)]
    mask = [0] * p + [1] * (n + 1)
    return Episode(ids, mask, [0.0] * len(ids), [0] * len(ids))


def synthetic_pairs(n: int, seed: int) -> list:
    """Chosen responses contain token 7, rejected ones token 8, at random places."""
    rng = np.random.default_rng(seed)
    return [(synthetic_episode(rng, 7), synthetic_episode(rng, 8)) for _ in range(n)]


def test_loss_fn_reads_the_head_at_the_last_policy_token():
    pairs = synthetic_pairs(1, seed=3)
    batch = pair_batch(pairs, TrajectoryConfig(buckets=(32,), batch_multiple=8))  # 1 real pair + 3 padding pairs
    B, T = batch.tokens.shape
    values = jnp.asarray(100.0 * np.arange(B)[:, None] + np.arange(T)[None, :], jnp.float32) * 0.01
    out = PolicyOutputs(logp=jnp.zeros((B, T)), entropy=jnp.zeros((B, T)), values=values)
    last = [len(ep) - 1 for ep in pairs[0]]  # the stop id ends each response
    assert all(batch.tokens[r, last[r]] == 2 and batch.loss_mask[r, last[r] + 1] == 0 for r in (0, 1))
    scores = np.asarray(reward_scores(out, batch))
    np.testing.assert_allclose(scores[:2], [values[0, last[0] + 1], values[1, last[1] + 1]])  # head at token l
    loss, metrics = REWARD_MODEL_LOSSES["bradley_terry"](out, batch, LossConfig(rm_margin=0.1))
    want, _ = np_bradley_terry(scores[:1], scores[1:2], [0.1], 0.0, np.ones(1))
    np.testing.assert_allclose(loss, want, rtol=1e-5)  # the padding pairs count for nothing
    assert "bradley_terry" not in LOSSES  # a scorer's loss, not a policy's
    with pytest.raises(ValueError, match="scalar head"):
        REWARD_MODEL_LOSSES["bradley_terry"](replace(out, values=None), batch, LossConfig())
    with pytest.raises(ValueError, match="without policy"):
        pair_batch([(pairs[0][0], replace(pairs[0][1], loss_mask=[0] * len(pairs[0][1])))])


# ---- rm-train end to end (one compiled train step for the module) ----
@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy = tw.tiny_model()
    hf.save_pretrained(policy, policy.config, str(root / "policy"))
    save_preference_pairs(str(root / "pairs.jsonl"), synthetic_pairs(160, seed=0))
    assert cli.main(["rm-train", f"--rm.pairs={root / 'pairs.jsonl'}", f"--rm.init={root / 'policy'}",
                     "--rm.steps=60", "--rm.batch_size=16", "--rm.learning_rate=3e-3", "--rm.heldout_fraction=0.25",
                     f"--rm.run_dir={root / 'run'}"]) == 0
    with open(root / "run" / "rm_summary.json") as f:
        return root, json.load(f)


def test_rm_train_learns_to_rank_held_out_pairs(rm_run):
    root, summary = rm_run
    assert summary["train_pairs"] == 120 and summary["heldout_pairs"] == 40
    assert summary["heldout"]["accuracy"] >= HELD_OUT_ACCURACY, summary
    assert summary["heldout"]["margin"] > 0
    lines = [json.loads(x) for x in open(root / "run" / "metrics.jsonl")]
    assert lines[0]["rm/loss"] == pytest.approx(np.log(2.0), abs=1e-4)  # zero head: every score 0 at step 1
    assert lines[0]["rm/rm_accuracy"] == 0.5 and lines[-1]["rm/loss"] < 0.2
    meta = json.load(open(root / "run" / "reward_model" / META_FILE))
    assert meta["kind"] == "bradley_terry" and meta["heldout"] == summary["heldout"]


def test_frozen_scorer_matches_training_path_and_export_round_trip(rm_run):
    root, _ = rm_run
    model = load_reward_model(str(root / "run" / "reward_model"))
    pairs = synthetic_pairs(4, seed=9)
    rm = RewardModel(model, TrajectoryConfig(buckets=(32,)), batch_size=4)
    frozen = rm.score([e for p in pairs for e in p])
    # the training path: the train step's own forward over the pair batch
    ts = make_train_step(REWARD_MODEL_LOSSES["bradley_terry"], optax.sgd(0.0), TrainConfig(compiler_options=tw.FAST),
                         model)
    batch = pair_batch(pairs, TrajectoryConfig(buckets=(32,), batch_multiple=8))
    trained_path = np.asarray(reward_scores(ts.outputs(ts.init_state(model), batch), batch))
    np.testing.assert_allclose(frozen, trained_path, atol=1e-5)
    assert (frozen[0::2] > frozen[1::2]).all()
    # save -> load gives the same scores; a policy directory (no head) is not a reward model
    again = RewardModel(with_scalar_head(model), TrajectoryConfig(buckets=(32,)), batch_size=4)
    np.testing.assert_array_equal(again.score([e for p in pairs for e in p]), frozen)
    with pytest.raises(FileNotFoundError, match="not a reward model"):
        load_reward_model(str(root / "policy"))
    with pytest.raises(ValueError, match="scalar head"):
        RewardModel(tw.tiny_model())
    with pytest.raises(ValueError, match="share the policy's tokenizer"):
        rm.score([Episode([1, 500], [0, 1], [0.0, 0.0], [0, 0])])


def test_reward_model_is_bit_identical_after_a_policy_update(rm_run):
    """The worst case: the policy is the very model the reward model was initialised from, and
    the policy's train step donates its state buffers."""
    root, _ = rm_run
    policy, _ = hf.load_pretrained(str(root / "policy"))
    rm = RewardModel(load_reward_model(str(root / "run" / "reward_model")), TrajectoryConfig(buckets=(32,)), 8)
    eps = tw.random_episodes(8, seed=1)
    before = jax.tree.map(np.array, rm.params)
    scores = rm.score(eps)
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=1e-2)),
                         TrainConfig(compiler_options=tw.FAST), policy)
    state = ts.init_state(policy)
    p0 = jax.tree.map(np.array, state.params)
    state, metrics = ts(state, collate([replace(e, reward=rm_s) for e, rm_s in zip(eps, scores)],
                                       TrajectoryConfig(buckets=(32,), batch_multiple=8))[0])
    assert any(not np.array_equal(p0[k], np.asarray(state.params[k])) for k in p0), "the policy did not move"
    after = jax.tree.map(np.array, rm.params)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(rm.score(eps), scores)


def test_rm_train_reports_a_bad_pairs_line(tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": {"ids": [1], "loss_mask": [1]}, "rejected": {"ids": [2], "loss_mask": [1]}}\n'
                    '{"a": {"ids": [1], "loss_mask": [1]}, "b": {"ids": [2], "loss_mask": [1]}, "label": "b"}\n')
    with pytest.raises(SystemExit) as e:
        cli.main(["rm-train", f"--rm.pairs={path}", f"--rm.run_dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert "pairs.jsonl:2: field 'label' must be 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["rm-train", f"--rm.pairs={tmp_path / 'missing.jsonl'}"])
    assert "no preference pairs file" in capsys.readouterr().err


# ---- the RL loop on verifier + reward model ----
@pytest.mark.slow
def test_rl_on_verifier_plus_reward_model_logs_both(tmp_path):
    from test_rl import ROLLOUT, SAMPLING, TASKS, TOOLS, TRAJ, rl_config

    from jaxrl_agent.loops.rl import train_rl
    from jaxrl_agent.model.decoder import CausalLM, ModelConfig
    from jaxrl_agent.tokenizer import load_tokenizer

    tok = load_tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    policy = CausalLM(cfg, rngs=nnx.Rngs(0))
    rm_model = with_scalar_head(policy)  # starts from the policy's own weights
    rm_model.value_w.set_value(jnp.asarray(np.random.default_rng(0).normal(size=32), jnp.float32))
    rm = RewardModel(rm_model, TRAJ, batch_size=16)
    before = jax.tree.map(np.array, rm.params)
    rewards = RewardConfig(source="sum", reward_model_weight=0.5, normalize=True, clip=2.0,
                           interface_error_penalty=-0.1, pairs_out=str(tmp_path / "pairs.jsonl"))
    res = train_rl(policy, tok, rl=rl_config(tmp_path, iterations=1, require_signal=False, eval_samples=2),
                   rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(), optim=OptimConfig(learning_rate=1e-3),
                   tools=TOOLS, traj=TRAJ, train_tasks=TASKS, eval_tasks=TASKS[:1], show_progress=False,
                   rewards=rewards, reward_model=rm)
    it = res["iterations"][0]
    assert np.isfinite(it["train/loss"])
    # both components reached the log, and they add up to what the update trained on
    for key in ("verifier_mean", "reward_model_mean", "reward_model_std", "reward_model_used_mean", "shaping_mean"):
        assert np.isfinite(it[f"reward/{key}"]), key
    assert it["reward/reward_model_std"] > 0  # the scorer tells episodes apart
    assert it["reward/total_mean"] == pytest.approx(it["reward/verifier_mean"] + 0.5 * it["reward/reward_model_used_mean"]
                                                    + it["reward/shaping_mean"], abs=1e-5)
    # an untrained policy's calls never parse: every turn is an interface error and pays for it
    assert it["reward/shaping_mean"] == pytest.approx(-0.1 * it["rollout/mean_turns"])
    lines = [json.loads(x) for x in open(os.path.join(rl_config(tmp_path).run_dir, "metrics.jsonl"))]
    assert any("reward/reward_model_mean" in x for x in lines)
    # the policy moved; the reward model did not
    moved = jax.tree.leaves(res["train_step"].policy_params(res["state"]))
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(nnx.state(policy, nnx.Param)), moved))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.array, rm.params))):
        np.testing.assert_array_equal(a, b)
    # verifier rewards were all equal, so the loop yielded no preference pairs (and wrote none)
    assert not os.path.exists(tmp_path / "pairs.jsonl")
