"""A packed forward (`TrajectoryConfig.pack_forward`): the rows stay one episode each for the
loss, the model runs them packed several to a row, and the outputs and gradients equal the
rows run one by one. The reference throughout is the same episodes collated without packing."""
from dataclasses import replace

import jax
import numpy as np
import pytest
from test_shared_prefix import assert_same_gradient, assert_same_mini_batch_updates, grouped_episodes

import trainer_worker as tw
from jaxrl_agent.config import TrainConfig, TrajectoryConfig
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.trajectory import collate

ROWS = TrajectoryConfig(buckets=(64,), share_prefix_min=0)  # room for 2-5 episodes a packed row
PACKED = replace(ROWS, pack_forward=True)
ROW_LEAVES = ("tokens", "positions", "attention_mask", "loss_mask", "sampler_logp", "turn_id", "token_rewards",
              "group_id", "reward")


# ---- collate ----
def test_collate_packs_every_row_where_its_slot_says():
    eps = grouped_episodes()
    rows, _ = collate(eps, replace(ROWS, batch_multiple=4))
    packed, info = collate(eps, replace(PACKED, batch_multiple=4))
    for name in ROW_LEAVES:  # what a loss reads is untouched
        np.testing.assert_array_equal(getattr(packed, name), getattr(rows, name), err_msg=name)
    assert rows.pack_tokens is None and packed.prefix_tokens is None
    b, t = packed.tokens.shape
    pk, tk = packed.pack_tokens.shape
    assert tk == t and pk % 4 == 0 and pk < b  # fewer rows: the episodes fill each other's padding
    flat = {k: getattr(packed, f"pack_{k}").reshape(-1) for k in ("tokens", "positions", "segments")}
    seen = set()
    for r, ep in enumerate(eps):
        n, slot = len(ep), packed.pack_slot[r]
        assert flat["tokens"][slot[:n]].tolist() == ep.ids
        assert flat["positions"][slot[:n]].tolist() == list(range(n))
        assert (slot[n:] == pk * tk).all()  # padding reads the zero past the end
        assert (np.diff(slot[:n]) == 1).all() and slot[0] // tk == slot[n - 1] // tk  # one run in one packed row
        segment = flat["segments"][slot[:n]]
        assert (segment == segment[0]).all() and segment[0] > 0
        key = (int(slot[0] // tk), int(segment[0]))
        assert key not in seen  # no two episodes share a segment of a packed row
        seen.add(key)
    assert (packed.pack_slot[len(eps):] == pk * tk).all()  # padding rows pack nothing
    assert int((packed.pack_segments > 0).sum()) == sum(len(ep) for ep in eps)
    assert info.length == t


def test_collate_pack_shapes_and_errors():
    eps = grouped_episodes()
    assert collate(eps, replace(PACKED, pack_rows=(8, 16)))[0].pack_tokens.shape[0] == 8
    with pytest.raises(ValueError, match="exceed the largest of pack_rows"):
        collate(eps, replace(PACKED, pack_rows=(2,)))
    with pytest.raises(ValueError, match="multiples of batch_multiple"):
        collate(eps, replace(PACKED, batch_multiple=4, pack_rows=(6,)))
    with pytest.raises(ValueError, match="share_prefix_min"):
        collate(eps, replace(PACKED, share_prefix_min=4))
    with pytest.raises(ValueError, match="pack_forward packs the rows for the model only"):
        collate([replace(ep, reward=0.0, turn_rewards={}) for ep in eps], replace(PACKED, pack=True))


# ---- the model ----
@pytest.mark.parametrize("layout", ["unrolled", "scanned_remat"])
def test_policy_outputs_packed_equal_the_rows(layout):
    overrides = dict(value_head=True) if layout == "unrolled" else dict(value_head=True, unroll_layers=0, remat=True)
    model = tw.tiny_model(seed=1, **overrides)
    eps = grouped_episodes(seed=1)
    rows, _ = collate(eps, ROWS)
    packed, _ = collate(eps, PACKED)
    run = jax.jit(lambda b: policy_outputs(model, b.tokens, b.positions, b.attention_mask, chunk_size=8,
                                           packed=b.packed))
    out_r, out_p = run(rows), run(packed)
    for name in ("logp", "entropy", "values"):
        got, want = np.asarray(getattr(out_p, name)), np.asarray(getattr(out_r, name))
        for r, ep in enumerate(eps):
            np.testing.assert_allclose(got[r, :len(ep)], want[r, :len(ep)], atol=2e-5, rtol=1e-5,
                                       err_msg=f"{name} row {r}")
            assert got[r, 0] == 0.0 and (got[r, len(ep):] == 0.0).all()  # a row's start and its padding


# ---- the train step ----
@pytest.mark.parametrize("devices", [1, 2])
def test_train_step_gradient_equals_the_rows(devices):
    """With KL, recomputed old log-probs, two micro-batches and the loss's chunk skip, the packed
    batch's loss and gradient equal the rows' (on one device, and with rows and packed rows
    split over two)."""
    assert_same_gradient(ROWS, PACKED, devices)


def test_mini_batches_keep_every_packed_row():
    assert_same_mini_batch_updates(ROWS, PACKED)


# ---- the RL loop ----
def test_rl_loop_packs_when_asked_and_then_shares_nothing():
    from jaxrl_agent.config import RLConfig, RolloutConfig
    from jaxrl_agent.loops.rollout_batches import rollout_batch_config

    rl, rollout = RLConfig(tasks_per_iter=6), RolloutConfig(group_size=8)
    traj = rollout_batch_config(replace(TrajectoryConfig(), pack_forward=True), rl, rollout, TrainConfig(), mult=2)
    assert traj.pack_forward and traj.share_prefix_min == 0 and traj.row_buckets == (48,)
    with pytest.raises(ValueError, match="pack_forward needs the whole batch in one process"):
        rollout_batch_config(replace(TrajectoryConfig(), pack_forward=True), rl, rollout, TrainConfig(), mult=2,
                             processes=2)
