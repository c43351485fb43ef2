"""Shared prefixes (`TrajectoryConfig.share_prefix_min`): a GRPO group's common prompt is cut
out of its rows by `collate`, run once by the model, and trains to the same gradient as the
rows written out whole. The reference throughout is the same episodes collated without
sharing."""
from dataclasses import replace

import jax
import numpy as np
import pytest

import trainer_worker as tw
from jaxrl_agent.config import LossConfig, MeshConfig, OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.train import sharding as sh
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.trajectory import Episode, collate

WHOLE = TrajectoryConfig(buckets=(16, 32, 48), share_prefix_min=0)
SHARED = replace(WHOLE, share_prefix_min=4)


def grouped_episodes(seed: int = 0, vocab: int = 128) -> list[Episode]:
    """Groups 0-2 of four episodes on one prompt each (group 1's members also sample the same
    first token, which carries a loss and so is never shared); group 3 a lone episode; group
    4 two episodes whose prompts part after 2 tokens (too short to share). Multi-turn, graded
    rewards, one shaped turn reward."""
    rng = np.random.default_rng(seed)
    out = []

    def episode(prompt, group, first=None):
        r1 = list(map(int, rng.integers(0, vocab, int(rng.integers(2, 6)))))
        if first is not None:
            r1[0] = first
        obs = list(map(int, rng.integers(0, vocab, int(rng.integers(1, 4)))))
        r2 = list(map(int, rng.integers(0, vocab, int(rng.integers(1, 5)))))
        ids = prompt + r1 + obs + r2
        mask = [0] * len(prompt) + [1] * len(r1) + [0] * len(obs) + [1] * len(r2)
        turn = [0] * (len(prompt) + len(r1)) + [1] * (len(obs) + len(r2))
        logp = [float(-rng.random() * 3) if m else 0.0 for m in mask]
        return Episode(ids, mask, logp, turn, reward=float(rng.random()), group_id=group,
                       turn_rewards={0: 0.25} if rng.random() < 0.3 else {})

    for g in range(3):
        prompt = list(map(int, rng.integers(0, vocab, int(rng.integers(8, 14)))))
        out += [episode(prompt, g, first=7 if g == 1 else None) for _ in range(4)]
    out.append(episode(list(map(int, rng.integers(0, vocab, 10))), 3))
    stem = list(map(int, rng.integers(0, vocab, 2)))
    out += [episode(stem + list(map(int, rng.integers(0, vocab, 6))), 4) for _ in range(2)]
    return out


def _rows_whole(batch) -> list[list[int]]:
    """Each row's sequence written out: its prefix's real tokens, then its own."""
    out = []
    for b in range(batch.tokens.shape[0]):
        k = int(batch.prefix_index[b])
        prefix = batch.prefix_tokens[k][batch.prefix_mask[k] > 0].tolist()
        out.append(prefix + batch.tokens[b][batch.attention_mask[b] > 0].tolist())
    return out


# ---- collate ----
def test_collate_cuts_each_groups_prompt_once():
    eps = grouped_episodes()
    whole, _ = collate(eps, replace(WHOLE, batch_multiple=4))
    shared, info = collate(eps, replace(SHARED, batch_multiple=4))
    assert whole.prefix_tokens is None
    # three shared prompts + one empty prefix (the lone episode, the short-stem group, the
    # padding rows), padded to the row multiple
    assert shared.prefix_tokens.shape[0] % 4 == 0
    # a group's prompt less its last token (the first response token is never shared, even
    # where a group's members all sampled the same one)
    assert shared.prefix_mask.sum(1).tolist()[:4] == [eps[4 * g].loss_mask.index(1) - 1 for g in range(3)] + [0]
    assert shared.prefix_index[:len(eps)].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 3
    assert (shared.prefix_index[len(eps):] == 3).all()
    # every row reads back as its episode; positions continue from the prefix
    assert _rows_whole(shared)[:len(eps)] == [ep.ids for ep in eps]
    for b, ep in enumerate(eps):
        cut = int(shared.prefix_mask[shared.prefix_index[b]].sum())
        n = len(ep) - cut
        assert shared.positions[b, :n].tolist() == list(range(cut, len(ep)))
        assert shared.loss_mask[b, 0] == 0
    # nothing with a loss, a reward or a sampler log-prob moved into a prefix
    for name in ("loss_mask", "sampler_logp", "token_rewards"):
        np.testing.assert_allclose(getattr(shared, name).sum(1), getattr(whole, name).sum(1), rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(shared.reward, whole.reward)
    np.testing.assert_array_equal(shared.group_id, whole.group_id)
    # the rows hold everything but their prefixes: four rows per shared prompt
    cuts = [eps[4 * g].loss_mask.index(1) - 1 for g in range(3)]
    assert whole.attention_mask.sum() - shared.attention_mask.sum() == 4 * sum(cuts)
    assert info.length == shared.tokens.shape[1]


def test_collate_prefix_shapes_and_errors():
    eps = grouped_episodes()
    batch, _ = collate(eps, replace(SHARED, prefix_rows=(8, 16), prefix_buckets=(24,)))
    assert batch.prefix_tokens.shape == (8, 24)
    with pytest.raises(ValueError, match="exceed the largest of prefix_rows"):
        collate(eps, replace(SHARED, prefix_rows=(2,)))
    with pytest.raises(ValueError, match="multiples of batch_multiple"):
        collate(eps, replace(SHARED, batch_multiple=4, prefix_rows=(6,)))
    packed, _ = collate([replace(ep, reward=0.0, turn_rewards={}) for ep in eps], replace(SHARED, pack=True))
    assert packed.prefix_tokens is None  # a packed row holds several episodes: nothing shared
    # a batch where no group shares is padded whole
    assert collate(eps[12:], SHARED)[0].prefix_tokens is None


# ---- the model ----
@pytest.mark.parametrize("layout", ["unrolled", "scanned_remat"])
def test_policy_outputs_with_prefixes_equal_whole_rows(layout):
    overrides = dict(value_head=True) if layout == "unrolled" else dict(value_head=True, unroll_layers=0, remat=True)
    model = tw.tiny_model(seed=1, **overrides)
    eps = grouped_episodes(seed=1)
    whole, _ = collate(eps, WHOLE)
    shared, _ = collate(eps, SHARED)
    run = jax.jit(lambda b: policy_outputs(model, b.tokens, b.positions, b.attention_mask, chunk_size=8,
                                           prefix=b.prefix))
    out_w, out_s = run(whole), run(shared)
    for b, ep in enumerate(eps):
        cut = int(shared.prefix_mask[shared.prefix_index[b]].sum())
        n = len(ep) - cut
        # the row's position 0 is read as a row start (0); every later one as in the whole row
        for name in ("logp", "entropy", "values"):
            np.testing.assert_allclose(np.asarray(getattr(out_s, name))[b, 1:n],
                                       np.asarray(getattr(out_w, name))[b, cut + 1:len(ep)], atol=2e-5, rtol=1e-5,
                                       err_msg=f"{name} row {b}")


# ---- the train step ----
def assert_same_gradient(reference: TrajectoryConfig, layout: TrajectoryConfig, devices: int, seed: int = 2):
    """GRPO with KL to a reference, recomputed old log-probs, two micro-batches: the loss and its
    gradient on the episodes collated under `layout` equal those under `reference` (rows and
    the layout's extra leaves split over `devices`). Shared with tests/test_packed_forward.py."""
    mesh_cfg = MeshConfig(data=devices)
    mesh = sh.make_mesh(mesh_cfg, jax.devices()[:devices])
    cfg = TrainConfig(compiler_options=tw.FAST, mesh=mesh_cfg, loss=LossConfig(kl_coef=0.1), use_ref=True,
                      old_logp="recompute", num_micro_batches=2)
    model = tw.tiny_model(seed=seed)
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=1e-2)), cfg, model, mesh=mesh)
    state = ts.init_state(model)
    eps = grouped_episodes(seed=seed)
    multiple = 2 * devices  # micro-batches of whole data shards
    loss_r, m_r, g_r = ts.grads(state, collate(eps, replace(reference, batch_multiple=multiple))[0])
    loss_l, m_l, g_l = ts.grads(state, collate(eps, replace(layout, batch_multiple=multiple))[0])
    assert float(m_r["grad_norm"]) > 1e-3
    np.testing.assert_allclose(float(loss_l), float(loss_r), atol=1e-6)
    for k in g_r:
        np.testing.assert_allclose(np.asarray(g_l[k]), np.asarray(g_r[k]), atol=1e-6, rtol=1e-4, err_msg=k)


def assert_same_mini_batch_updates(reference: TrajectoryConfig, layout: TrajectoryConfig, seed: int = 3):
    """Two shuffled mini-batches x two epochs: each update's rows still find their layout's
    extra leaves, so the updated parameters equal the reference run's (SGD: Adam's g / sqrt(v)
    would blow up float summation-order noise in near-zero gradients)."""
    cfg = TrainConfig(compiler_options=tw.FAST, mesh=MeshConfig(data=1), num_mini_batches=2, ppo_epochs=2)
    mesh = sh.make_mesh(cfg.mesh, jax.devices()[:1])
    model = tw.tiny_model(seed=seed)
    ts = make_train_step(LOSSES["grpo"], tw.distributed_optimizer(), cfg, model, mesh=mesh)
    eps = grouped_episodes(seed=seed)
    after = []
    for traj in (reference, layout):
        state, metrics = ts(ts.init_state(model, seed=4), collate(eps, replace(traj, batch_multiple=2))[0])
        after.append(ts.policy_params(state))
        assert float(metrics["num_updates"]) == 4
    for k in after[0]:
        np.testing.assert_allclose(np.asarray(after[1][k]), np.asarray(after[0][k]), atol=2e-6, err_msg=k)


@pytest.mark.parametrize("devices", [1, 2])
def test_train_step_gradient_equals_whole_rows(devices):
    """The shared batch trains to the whole rows' loss and gradient (on one device, and with
    rows and prefixes split over two)."""
    assert_same_gradient(WHOLE, SHARED, devices)


def test_mini_batches_keep_every_prefix():
    assert_same_mini_batch_updates(WHOLE, SHARED)


# ---- where the RL loop shares ----
def test_rl_loop_shares_prompts_when_a_batch_is_one_update():
    from jaxrl_agent.config import RLConfig, RolloutConfig
    from jaxrl_agent.loops.rollout_batches import SHARE_PREFIX_MIN, rollout_batch_config
    from jaxrl_agent.trajectory import shape_episodes

    # an episode budget of 320 tokens: cutting the prompt lands the longest row in a smaller bucket
    rl, traj = RLConfig(tasks_per_iter=6), TrajectoryConfig(buckets=(256, 512))
    rollout = RolloutConfig(group_size=8, max_total_tokens=320)
    assert TrajectoryConfig().share_prefix_min is None and collate(grouped_episodes(), WHOLE)[0].prefix_tokens is None
    one = rollout_batch_config(traj, rl, rollout, TrainConfig(), mult=2, prompt_len=lambda: 80)
    # one prefix shape per run: the bucket of the tasks' longest prompt
    assert (one.share_prefix_min, one.prefix_rows, one.prefix_buckets) == (SHARE_PREFIX_MIN, (8,), (256,))
    assert rollout_batch_config(traj, rl, rollout, TrainConfig(), mult=2, prompt_len=lambda: 300).prefix_buckets == (512,)
    assert rollout_batch_config(traj, rl, rollout, TrainConfig(), mult=2, prompt_len=lambda: 900).prefix_buckets == (512,)
    assert one.row_buckets == (48,)
    # multi-turn episodes up to 1024 tokens: a 175-token prompt cut out leaves the rows in the
    # same bucket, where the prefixes would only add work (benchmarks/bench_update_layouts.py)
    long = rollout_batch_config(traj, rl, replace(rollout, max_total_tokens=1024), TrainConfig(), mult=2,
                                prompt_len=lambda: 175)
    assert long.share_prefix_min == 0
    # with mini-batches every mini-batch would run every prefix: whole rows
    assert rollout_batch_config(traj, rl, rollout, TrainConfig(num_mini_batches=4), mult=2).share_prefix_min == 0
    # an explicit setting wins; processes and groups of one never share
    assert rollout_batch_config(replace(traj, share_prefix_min=8), rl, rollout, TrainConfig(num_mini_batches=4),
                                mult=2).share_prefix_min == 8
    assert rollout_batch_config(traj, rl, rollout, TrainConfig(), mult=2, processes=2).share_prefix_min == 0
    assert rollout_batch_config(traj, rl, RolloutConfig(group_size=1), TrainConfig(), mult=2).share_prefix_min == 0
    # the batch the loop precompiles has a rollout batch's tree and shapes
    shaped = collate(shape_episodes(one), replace(one, buckets=(256,)))[0]
    rng = np.random.default_rng(0)
    rollout_eps = []
    for task in range(6):  # 6 tasks x 8 episodes, prompts of 40-80 tokens
        prompt = rng.integers(0, 128, int(rng.integers(40, 80))).tolist()
        for _ in range(8):
            n = int(rng.integers(3, 30))
            rollout_eps.append(Episode(prompt + rng.integers(0, 128, n).tolist(), [0] * len(prompt) + [1] * n,
                                       [0.0] * (len(prompt) + n), [0] * (len(prompt) + n), 1.0, task))
    real = collate(rollout_eps, replace(one, buckets=(256,)))[0]
    assert real.prefix_tokens is not None
    assert jax.tree.structure(shaped) == jax.tree.structure(real)
    assert [x.shape for x in jax.tree.leaves(shaped)] == [x.shape for x in jax.tree.leaves(real)]
