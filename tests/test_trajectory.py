"""Tests for trajectory.py: padding, buckets, rewards on the last policy token, overflow policy,
packing (== unpacked under the model), DPO pair layout, clear errors."""
import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import trainer_worker as tw
from jaxrl_agent.config import TrajectoryConfig
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.trajectory import Episode, bucket_length, collate, preference_pairs


def _ep(n, p=2, reward=0.0, group=0, start=1):
    ids = list(range(start, start + n))
    mask = [0] * p + [1] * (n - p)
    return Episode(ids, mask, [-0.5 * m for m in mask], [0] * n, reward, group)


def test_collate_pads_to_bucket_and_multiple():
    eps = [_ep(5, reward=1.0, group=7), _ep(9, p=3, reward=0.5, group=7), _ep(3, group=8)]
    batch, info = collate(eps, TrajectoryConfig(buckets=(4, 8, 16), batch_multiple=4))
    assert batch.tokens.shape == (4, 16) and info.length == 16 and info.rows == ((0,), (1,), (2,), ())
    for r, ep in enumerate(eps):
        n = len(ep)
        np.testing.assert_array_equal(batch.tokens[r, :n], ep.ids)
        np.testing.assert_array_equal(batch.positions[r, :n], np.arange(n))
        np.testing.assert_array_equal(batch.loss_mask[r, :n], ep.loss_mask)
        # padding: every mask 0, turn_id -1, no reward, no sampler log-prob
        for name in ("attention_mask", "loss_mask", "sampler_logp", "token_rewards"):
            assert not np.any(getattr(batch, name)[r, n:]), name
        assert np.all(batch.turn_id[r, n:] == -1) and np.all(batch.attention_mask[r, :n] == 1)
        last = max(i for i, m in enumerate(ep.loss_mask) if m)
        assert batch.token_rewards[r, last] == ep.reward and batch.token_rewards[r].sum() == ep.reward
    np.testing.assert_array_equal(batch.reward, [1.0, 0.5, 0.0, 0.0])
    assert list(batch.group_id[:3]) == [7, 7, 8]
    assert batch.group_id[3] not in (7, 8)  # a padding row is a group of its own
    assert not batch.attention_mask[3].any() and np.all(batch.turn_id[3] == -1)
    assert batch.tokens.dtype == np.int32 and batch.sampler_logp.dtype == np.float32
    assert batch.ref_logp is None and batch.old_logp is None and batch.advantages is None


def test_row_buckets_bound_the_batch_shapes():
    cfg = TrajectoryConfig(buckets=(8,), batch_multiple=2, row_buckets=(4, 8))
    shapes = {collate([_ep(4)] * n, cfg)[0].tokens.shape for n in range(1, 9)}
    assert shapes == {(4, 8), (8, 8)}
    with pytest.raises(ValueError, match=r"9 rows exceed the largest of row_buckets \(4, 8\)"):
        collate([_ep(4)] * 9, cfg)
    with pytest.raises(ValueError, match="multiples of batch_multiple"):
        collate([_ep(4)], TrajectoryConfig(buckets=(8,), batch_multiple=4, row_buckets=(6,)))


def test_padding_groups_never_collide_with_negative_group_ids():
    batch, _ = collate([_ep(4, group=-1), _ep(4, group=-2)], TrajectoryConfig(buckets=(4,), batch_multiple=4))
    assert len(set(batch.group_id.tolist())) == 4


def test_bucket_choice_and_overflow_policy():
    assert bucket_length(5, (8, 4, 16)) == 8 and bucket_length(8, (4, 8)) == 8
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket_length(17, (8, 16))
    long = _ep(20, reward=1.0)
    with pytest.raises(ValueError, match="episode 1 has 20 tokens"):
        collate([_ep(4), long], TrajectoryConfig(buckets=(8, 16)))
    batch, info = collate([_ep(4), long], TrajectoryConfig(buckets=(8, 16), overflow="truncate"))
    assert batch.tokens.shape == (2, 16) and "truncated from 20 to 16" in info.truncated[1]
    assert 0 not in info.truncated
    assert batch.token_rewards[1, 15] == 1.0  # the last kept policy token carries the reward


@pytest.mark.parametrize("bad, match", [
    (Episode([1, 2], [0], [0.0, 0.0], [0, 0]), "per-token lists"),
    (Episode([1, 2], [0, 2], [0.0, 0.0], [0, 0]), "only 0 and 1"),
    (Episode([], [], [], []), "empty episode"),
    (Episode([1], [1], [0.0], [0], termination="crashed"), "unknown termination"),
    (Episode([1], [1], [0.0], [0], reward=float("nan")), "finite"),
])
def test_bad_episodes_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        collate([bad])


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="at least one"):
        collate([])
    with pytest.raises(ValueError, match="overflow"):
        collate([_ep(3)], TrajectoryConfig(overflow="drop"))
    with pytest.raises(ValueError, match="batch_multiple"):
        collate([_ep(3)], TrajectoryConfig(batch_multiple=0))


def test_from_builder_copies_lists():
    builder = SimpleNamespace(ids=[5, 6, 7], loss_mask=[0, 1, 1], sampler_logp=[0.0, -1.0, -2.0], turn_id=[0, 0, 0])
    ep = Episode.from_builder(builder, reward=1.0, group_id=3, termination="submitted")
    builder.ids.append(8)
    assert ep.ids == [5, 6, 7] and ep.reward == 1.0 and ep.group_id == 3
    ep.validate()


def test_packing_layout():
    eps = [_ep(6, start=10), _ep(5, start=20), _ep(9, start=30), _ep(3, start=40)]
    batch, info = collate(eps, TrajectoryConfig(buckets=(8, 12), pack=True, batch_multiple=1))
    assert batch.tokens.shape[1] == 12 and len(info.rows) == batch.tokens.shape[0] < len(eps)
    assert sorted(i for row in info.rows for i in row) == [0, 1, 2, 3]
    for r, row in enumerate(info.rows):
        start = 0
        for seg, i in enumerate(row, start=1):
            n = len(eps[i])
            np.testing.assert_array_equal(batch.tokens[r, start:start + n], eps[i].ids)
            np.testing.assert_array_equal(batch.positions[r, start:start + n], np.arange(n))  # restart
            assert np.all(batch.attention_mask[r, start:start + n] == seg)
            start += n
        assert not batch.attention_mask[r, start:].any()
    with pytest.raises(ValueError, match="packing is for token-level"):
        collate([_ep(3, reward=1.0)], TrajectoryConfig(pack=True))


def test_packed_logp_equals_unpacked():
    """Segment ids in attention_mask keep packed episodes from seeing each other: every
    segment's log-probs (and entropies) equal those of the episode alone."""
    model = tw.tiny_model()
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, b: policy_outputs(nnx.merge(graphdef, s), b.tokens, b.positions, b.attention_mask,
                                              chunk_size=8))
    eps = [dataclasses.replace(ep, reward=0.0) for ep in tw.random_episodes(5, seed=1, min_len=4, max_len=10)]
    plain, _ = collate(eps, TrajectoryConfig(buckets=(24,)))
    packed, info = collate(eps, TrajectoryConfig(buckets=(24,), pack=True))
    assert packed.tokens.shape[0] < plain.tokens.shape[0]
    out_plain = fwd(state, jax.tree.map(jnp.asarray, plain))
    out_packed = fwd(state, jax.tree.map(jnp.asarray, packed))
    for r, row in enumerate(info.rows):
        start = 0
        for i in row:
            n = len(eps[i])
            m = np.asarray(eps[i].loss_mask, bool)  # the first token of a segment has no prediction
            for name in ("logp", "entropy"):
                got = np.asarray(getattr(out_packed, name))[r, start:start + n][m]
                want = np.asarray(getattr(out_plain, name))[i, :n][m]
                np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
            start += n


def test_preference_pairs_layout():
    pairs = [(_ep(4, start=1), _ep(6, start=50)), (_ep(5, start=100), _ep(3, start=150))]
    batch = preference_pairs(pairs, TrajectoryConfig(buckets=(8,), batch_multiple=4))
    assert batch.tokens.shape == (4, 8)
    np.testing.assert_array_equal(batch.tokens[0, :4], pairs[0][0].ids)  # row 2i chosen
    np.testing.assert_array_equal(batch.tokens[1, :6], pairs[0][1].ids)  # row 2i+1 rejected
    np.testing.assert_array_equal(batch.tokens[3, :3], pairs[1][1].ids)
    assert list(batch.group_id) == [0, 0, 1, 1] and not batch.reward.any()
    odd = preference_pairs(pairs[:1], TrajectoryConfig(buckets=(8,), batch_multiple=1))
    assert odd.tokens.shape[0] == 2
    with pytest.raises(ValueError, match="even"):
        preference_pairs(pairs, TrajectoryConfig(buckets=(8,), batch_multiple=3))
    with pytest.raises(ValueError, match="cannot be packed"):
        preference_pairs(pairs, TrajectoryConfig(buckets=(8,), pack=True))


# ---- the one episode file format ----
def test_episodes_jsonl_round_trip_and_bad_lines_named(tmp_path):
    from jaxrl_agent.trajectory import load_episodes, save_episodes

    eps = [Episode([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25], [0, 0, 0], 1.0, group_id=3, termination="submitted",
                   info={"task_id": "t0"}, turn_rewards={0: -0.1}),
           Episode([4, 5], [0, 1], [0.0, -1.0], [0, 0], 0.0)]
    path = tmp_path / "eps.jsonl"
    save_episodes(str(path), eps)
    assert load_episodes(str(path)) == eps
    save_episodes(str(path), eps[:1], append=True)
    assert len(load_episodes(str(path))) == 3
    # the older study / sft lines (no sampler_logp, group_id, turn_rewards) still read
    path.write_text('{"ids": [1, 2], "loss_mask": [0, 1], "turn_id": [0, 0], "reward": 1.0, '
                    '"termination": "submitted", "info": {}}\n\n')
    (old,) = load_episodes(str(path))
    assert old.sampler_logp == [0.0, 0.0] and old.reward == 1.0
    for text, what in [('{"ids": [1, 2]}\n', "loss_mask"), ("not json\n", "invalid JSON"),
                       ('{"ids": [1], "loss_mask": [2]}\n', "loss_mask must hold only 0 and 1")]:
        path.write_text('{"ids": [1], "loss_mask": [1]}\n' + text)
        with pytest.raises(ValueError, match=f"eps.jsonl:2: .*{what}"):
            load_episodes(str(path))
