"""Tests for agent/rewards.py and the per-turn reward path of trajectory.py: turn outcomes from a
tool session's history, shaped rewards on the last policy token of their turn, GAE /
REINFORCE++ crediting them by position and GRPO by the episode total (against the NumPy
references), running normalisation, composition of verifier and reward-model rewards,
preference-pair io and mining. No model is compiled here."""
import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as ref
from jaxrl_agent import advantages as adv_lib
from jaxrl_agent.agent.preference_pairs import (PreferenceDataError, load_preference_pairs, pairs_from_groups,
                                                save_preference_pairs)
from jaxrl_agent.agent.rewards import RewardComposer, RunningMeanStd, shaped_turn_rewards, turn_outcomes
from jaxrl_agent.config import RewardConfig, TrajectoryConfig
from jaxrl_agent.trajectory import Episode, collate

TRAJ = TrajectoryConfig(buckets=(16,))


def _step(name=None, ok=True, error=False, changed=None):
    call = None if error else SimpleNamespace(name=name)
    return ("text", SimpleNamespace(error="parse" if error else None, call=call, tool_ok=ok, changed=changed))


def _three_turns(reward=1.0, group=0, turn_rewards=None, start=1):
    """prompt (2) | turn 0: 3 policy tokens | obs (2) | turn 1: 2 policy | obs (1) | turn 2: 2 policy."""
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
    turn = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    n = len(mask)
    return Episode(list(range(start, start + n)), mask, [-0.3 * m for m in mask], turn, reward, group,
                   "submitted", {}, dict(turn_rewards or {}))


# ---- turn outcomes and shaping ----
def test_turn_outcomes_label_each_turn():
    history = [_step(error=True), _step("read_file", ok=False), _step("run_tests"), _step("run_tests"),
               _step("str_replace", ok=False), _step("run_tests"), _step("str_replace"), _step("run_tests"),
               _step("submit")]
    assert turn_outcomes(history) == ["interface_error", "tool_error", "ok", "repeated_test",
                                      "tool_error", "repeated_test",  # a failed edit changed nothing
                                      "ok", "ok", "ok"]
    cfg = RewardConfig(interface_error_penalty=-0.2, repeated_test_penalty=-0.05)
    assert shaped_turn_rewards(turn_outcomes(history), cfg) == {0: -0.2, 3: -0.05, 5: -0.05}
    assert shaped_turn_rewards(turn_outcomes(history), RewardConfig()) == {}  # off by default
    with pytest.raises(ValueError, match="unknown turn outcome 'oops' at turn 1"):
        shaped_turn_rewards(["ok", "oops"], cfg)


def test_an_edit_that_changed_nothing_is_its_own_outcome():
    """Rewriting a line with what it holds is labelled, and the test run after it is a repeat:
    the workspace is the one the previous run saw."""
    history = [_step("replace_lines", changed=True), _step("run_tests"), _step("replace_lines", changed=False),
               _step("run_tests"), _step("str_replace", changed=False), _step("replace_lines", ok=False),
               _step("replace_lines", changed=True), _step("run_tests")]
    assert turn_outcomes(history) == ["ok", "ok", "unchanged_edit", "repeated_test", "unchanged_edit",
                                      "tool_error", "ok", "ok"]
    cfg = RewardConfig(unchanged_edit_penalty=-0.1)
    assert shaped_turn_rewards(turn_outcomes(history), cfg) == {2: -0.1, 4: -0.1}


def test_turn_rewards_land_on_the_last_policy_token_of_their_turn():
    plain = _three_turns(reward=1.0)
    shaped = _three_turns(reward=1.0, turn_rewards={0: -0.25, 1: -0.5})
    b0, _ = collate([plain], TRAJ)
    b1, _ = collate([shaped], TRAJ)
    expect = np.zeros(16, np.float32)
    expect[4], expect[8], expect[11] = -0.25, -0.5, 1.0  # last policy token of turns 0, 1, and the episode
    np.testing.assert_array_equal(b1.token_rewards[0], expect)
    assert b1.reward[0] == pytest.approx(0.25) and b1.token_rewards[0].sum() == pytest.approx(b1.reward[0])
    # without shaping the batch is exactly what it always was
    assert np.flatnonzero(b0.token_rewards[0]).tolist() == [11] and b0.reward[0] == 1.0
    # a reward on the last turn adds to the outcome on the same token; a turn cut away is dropped
    b2, _ = collate([_three_turns(turn_rewards={2: -0.1, 7: -9.0})], TRAJ)
    assert b2.token_rewards[0, 11] == pytest.approx(0.9) and b2.reward[0] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="turn_rewards"):
        collate([_three_turns(turn_rewards={0: float("nan")})], TRAJ)
    with pytest.raises(ValueError, match="packing"):
        collate([_three_turns(reward=0.0, turn_rewards={0: -1.0})], TrajectoryConfig(buckets=(32,), pack=True))


def test_shaped_rewards_move_gae_and_reinforce_pp_by_position_grpo_by_total():
    rng = np.random.default_rng(0)
    eps = [_three_turns(reward=float(i % 2), group=i // 2, turn_rewards={0: -0.5} if i in (0, 3) else {})
           for i in range(4)]
    batch, _ = collate(eps, TRAJ)
    plain, _ = collate([_three_turns(reward=e.reward, group=e.group_id) for e in eps], TRAJ)
    mask, values = batch.loss_mask, rng.normal(size=batch.loss_mask.shape).astype(np.float32) * batch.loss_mask
    for gamma, lam in ((1.0, 1.0), (0.9, 0.8)):
        a, ret = adv_lib.gae(jnp.asarray(batch.token_rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
        a_ref, ret_ref = ref.gae(batch.token_rewards, values, mask, gamma, lam)
        np.testing.assert_allclose(a, a_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret, ret_ref, rtol=1e-5, atol=1e-6)
    # gamma = lam = 1, values 0: the advantage is the reward-to-go, so the penalty on turn 0's
    # last token moves turn 0's tokens by exactly -0.5 and leaves the later turns alone
    zero = jnp.zeros_like(jnp.asarray(values))
    a1 = np.asarray(adv_lib.gae(jnp.asarray(batch.token_rewards), zero, jnp.asarray(mask), gamma=1.0, lam=1.0)[0])
    a0 = np.asarray(adv_lib.gae(jnp.asarray(plain.token_rewards), zero, jnp.asarray(mask), gamma=1.0, lam=1.0)[0])
    turn0 = (batch.turn_id == 0) & (mask > 0)
    later = (batch.turn_id > 0) & (mask > 0)
    np.testing.assert_allclose((a1 - a0)[0][turn0[0]], -0.5)
    np.testing.assert_allclose((a1 - a0)[0][later[0]], 0.0)
    assert np.all(a1[1] == a0[1])  # an unshaped episode is untouched
    np.testing.assert_allclose(adv_lib.reinforce_pp(jnp.asarray(batch.token_rewards), jnp.asarray(mask), gamma=0.9),
                               ref.reinforce_pp(batch.token_rewards, mask, 0.9), rtol=1e-5, atol=1e-6)
    # GRPO sees only the total: every token of a shaped episode moves together
    np.testing.assert_allclose(batch.reward, [0.0 - 0.5, 1.0, 0.0, 1.0 - 0.5])
    np.testing.assert_allclose(adv_lib.grpo(jnp.asarray(batch.reward), jnp.asarray(batch.group_id)),
                               ref.grpo(batch.reward, batch.group_id), rtol=1e-5, atol=1e-6)


# ---- normalisation and composition ----
def test_running_mean_std_equals_all_values_at_once():
    rng = np.random.default_rng(1)
    chunks = [rng.normal(3.0, 2.0, size=n) for n in (1, 7, 30, 2)]
    stats = RunningMeanStd()
    for c in chunks:
        stats.update(c)
    every = np.concatenate(chunks)
    assert stats.count == every.size
    assert stats.mean == pytest.approx(every.mean()) and stats.std == pytest.approx(every.std())
    again = RunningMeanStd()
    again.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    np.testing.assert_allclose(again.normalize(every), (every - every.mean()) / (every.std() + 1e-6))


class FixedScorer:
    """A stand-in reward model: score = a fixed table lookup by the episode's first token."""

    def __init__(self, table):
        self.table, self.calls = table, 0

    def score(self, episodes):
        self.calls += 1
        return np.array([self.table[e.ids[0]] for e in episodes], np.float32)


def test_composer_sources_normalisation_clip_and_metrics():
    eps = [_three_turns(reward=r, start=s) for r, s in ((1.0, 1), (0.0, 2), (0.0, 3), (1.0, 4))]
    table = {1: 4.0, 2: -2.0, 3: 0.0, 4: 2.0}
    raw = np.array([4.0, -2.0, 0.0, 2.0])
    out, m = RewardComposer(RewardConfig())(eps)  # default: the verifier alone, nothing else
    assert [e.reward for e in out] == [1.0, 0.0, 0.0, 1.0] and all(not e.turn_rewards for e in out)
    assert "reward_model_mean" not in m and m["verifier_mean"] == 0.5 and m["total_mean"] == 0.5
    out, m = RewardComposer(RewardConfig(source="reward_model", reward_model_weight=0.5), FixedScorer(table))(eps)
    np.testing.assert_allclose([e.reward for e in out], 0.5 * raw)
    assert m["reward_model_mean"] == pytest.approx(1.0) and m["verifier_mean"] == 0.5
    assert m["reward_model_verifier_corr"] == pytest.approx(np.corrcoef(raw, [1, 0, 0, 1])[0, 1])
    comp = RewardComposer(RewardConfig(source="sum", verifier_weight=2.0, normalize=True, clip=1.0),
                          FixedScorer(table))
    out, m = comp(eps)
    z = np.clip((raw - raw.mean()) / (raw.std() + 1e-6), -1.0, 1.0)
    np.testing.assert_allclose([e.reward for e in out], 2.0 * np.array([1, 0, 0, 1]) + z, rtol=1e-6)
    assert out[0].info["reward_components"] == pytest.approx(
        {"verifier": 1.0, "shaping": 0.0, "total": 2.0 + z[0], "reward_model": 4.0, "reward_model_used": z[0]})
    assert eps[0].reward == 1.0 and "reward_components" not in eps[0].info  # the rollout's episodes keep the verifier's
    comp(eps[:2])  # the running statistics keep every score seen
    assert comp.stats.count == 6 and comp.stats.mean == pytest.approx(np.mean([*raw, 4.0, -2.0]))


def test_composer_per_turn_shaping_and_errors():
    eps = [_three_turns(reward=1.0), _three_turns(reward=0.0)]
    eps[0].info["turn_outcomes"] = ["ok", "repeated_test", "ok"]
    eps[1].info["turn_outcomes"] = ["interface_error", "tool_error", "ok"]
    cfg = RewardConfig(interface_error_penalty=-0.2, tool_error_penalty=-0.1, repeated_test_penalty=-0.05)
    out, m = RewardComposer(cfg)(eps)
    assert out[0].turn_rewards == {1: -0.05} and out[1].turn_rewards == {0: -0.2, 1: -0.1}
    assert [e.reward for e in out] == [1.0, 0.0]  # the outcome stays the outcome; shaping rides on turns
    assert m["shaping_mean"] == pytest.approx(-0.175) and m["total_mean"] == pytest.approx(0.5 - 0.175)
    batch, _ = collate(out, TRAJ)
    np.testing.assert_allclose(batch.reward, [0.95, -0.3])
    with pytest.raises(ValueError, match="unknown reward source"):
        RewardComposer(RewardConfig(source="judge"))
    with pytest.raises(ValueError, match="reward_model_path"):
        RewardComposer(RewardConfig(source="sum"))
    with pytest.raises(ValueError, match="clip"):
        RewardComposer(RewardConfig(clip=0.0))


# ---- preference pairs: from the loop and from JSONL ----
def test_pairs_from_groups_pair_differing_outcomes_of_one_task():
    eps = []
    for g, rewards in enumerate([(1.0, 0.0, 0.0, 1.0), (0.0, 0.0), (1.0, 0.0)]):
        for k, r in enumerate(rewards):
            eps.append(_three_turns(reward=r, group=g, start=10 * g + k))
            eps[-1].info["task_id"] = f"t{g}"
    eps.append(_three_turns(reward=1.0, group=1, start=99))
    eps[-1].termination = "sandbox_error"  # outcome unknown: never paired
    pairs = pairs_from_groups(eps, max_pairs_per_group=3, seed=0)
    assert len(pairs) == 3 + 1  # group 0 has 4 candidates (capped at 3), group 1 none, group 2 one
    for chosen, rejected in pairs:
        assert chosen.reward > rejected.reward and chosen.group_id == rejected.group_id
        assert chosen.termination != "sandbox_error"
    assert len({(id(c), id(r)) for c, r in pairs}) == len(pairs)
    assert len(pairs_from_groups(eps, max_pairs_per_group=10)) == 5


def test_preference_jsonl_round_trip_and_errors(tmp_path):
    a, b = _three_turns(reward=1.0, turn_rewards={1: -0.5}), _three_turns(reward=0.0, start=5)
    path = str(tmp_path / "pairs.jsonl")
    save_preference_pairs(path, [(a, b)])
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"a": {"ids": [1, 2], "loss_mask": [0, 1]}, "b": b.to_dict(), "label": 1}) + "\n")
    pairs = load_preference_pairs(path)
    assert pairs[0][0] == a and pairs[0][1] == b  # every field survives, turn_rewards' int keys too
    assert pairs[1][0] == b and pairs[1][1].ids == [1, 2] and pairs[1][1].turn_id == [0, 0]
    bad = {
        "not json": "invalid JSON",
        json.dumps({"a": a.to_dict(), "b": b.to_dict(), "label": 2}): "'label' must be 0",
        json.dumps({"chosen": a.to_dict()}): "missing field 'rejected'",
        json.dumps({"x": 1}): "expected fields",
        json.dumps({"chosen": a.to_dict(), "rejected": {"ids": [1, 2], "loss_mask": [1]}}): "field 'rejected'.*lengths",
        json.dumps({"chosen": a.to_dict(), "rejected": {"ids": "12", "loss_mask": [1]}}): "'ids' must be a list",
    }
    for line, match in bad.items():
        p = tmp_path / "bad.jsonl"
        p.write_text(json.dumps({"chosen": a.to_dict(), "rejected": b.to_dict()}) + "\n\n" + line + "\n")
        with pytest.raises(PreferenceDataError, match=f"bad.jsonl:3[: ].*{match}"):
            load_preference_pairs(str(p))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PreferenceDataError, match="no preference pairs"):
        load_preference_pairs(str(tmp_path / "empty.jsonl"))
