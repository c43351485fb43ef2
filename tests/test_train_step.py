"""Tests for train/step.py and train/lora.py: exact micro-batch accumulation (token-mean and
seq-mean), every registered loss lowering its loss through the step, PPO epochs /
mini-batches, old_logp recompute, the frozen reference, LoRA, schedules, errors."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainer_worker as tw
from jaxrl_agent.config import LoraConfig, LossConfig, MeshConfig, OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.losses.registry import ALGORITHM_DEFAULTS, LOSSES
from jaxrl_agent.train import lora as lora_lib
from jaxrl_agent.train import sharding as sh
from jaxrl_agent.train.step import lr_schedule, make_optimizer, make_train_step
from jaxrl_agent.trajectory import collate, preference_pairs

ONE = MeshConfig(data=1)


@pytest.fixture(scope="module")
def mesh1():
    return sh.make_mesh(ONE, jax.devices()[:1])


@pytest.fixture(scope="module")
def model():
    return tw.tiny_model()


@pytest.fixture(scope="module")
def batch():
    b, _ = collate(tw.random_episodes(8, seed=5), TrajectoryConfig(buckets=(32,)))
    return b


def _step(loss, cfg, model, mesh, lr=1e-2):
    return make_train_step(LOSSES[loss], make_optimizer(OptimConfig(learning_rate=lr)), cfg, model, mesh=mesh)


def _close(a, b, atol=1e-5):
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=atol, rtol=1e-4, err_msg=k)


# ---- exact gradient accumulation ----
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_four_micro_batches_equal_one_batch(model, batch, mesh1, agg):
    """Rows have different token counts, so averaging per-micro-batch losses would be wrong;
    the accumulated gradient must still equal the full batch's."""
    loss_cfg = LossConfig(agg=agg, kl_coef=0.1)
    base = TrainConfig(compiler_options=tw.FAST, loss=loss_cfg, mesh=ONE, use_ref=True, old_logp="recompute")
    full = _step("grpo", base, model, mesh1)
    # seq-mean also checks that advantages precomputed over the batch == the loss's own
    micro_cfg = replace(base, num_micro_batches=4, advantage="grpo" if agg != "token-mean" else "loss")
    micro = _step("grpo", micro_cfg, model, mesh1)
    loss_f, m_f, g_f = full.grads(full.init_state(model), batch)
    loss_m, m_m, g_m = micro.grads(micro.init_state(model), batch)
    assert abs(float(loss_f) - float(loss_m)) < 1e-6
    assert float(m_f["grad_norm"]) > 1e-3
    _close(g_f, g_m)
    # recomputed old_logp and a fresh reference: ratio 1 and KL 0 at the first update
    assert abs(float(m_m["ratio_mean"]) - 1.0) < 1e-6 and abs(float(m_m["kl"])) < 1e-6
    assert float(m_m["clipfrac"]) == 0.0
    if agg == "token-mean":  # the naive mean of micro-batch losses differs measurably
        counts = np.asarray(batch.loss_mask).sum(1)
        assert len(set(counts.tolist())) > 1
        naive = jax.tree.map(jnp.zeros_like, g_f)
        for k in range(4):
            rows = jax.tree.map(lambda x: x[k::4], batch)
            sub = _step("grpo", replace(base, num_micro_batches=1), model, mesh1) if k == 0 else sub
            _, _, g_k = sub.grads(sub.init_state(model), rows)
            naive = jax.tree.map(lambda a, b: a + b / 4, naive, g_k)
        diff = max(float(jnp.abs(naive[k] - g_f[k]).max()) for k in g_f)
        assert diff > 1e-4


# ---- every registered loss through the step ----
@pytest.fixture(scope="module")
def fixed_batches(model, mesh1):
    """Fixed batches whose old_logp is the initial policy's, so each step's pre-update loss
    is one objective evaluated at the current parameters (one scoring compile for all)."""
    eps = tw.random_episodes(8, seed=6)
    rl, _ = collate(eps, TrajectoryConfig(buckets=(32,)))
    pairs = preference_pairs(list(zip(eps[0::2], eps[1::2])), TrajectoryConfig(buckets=(32,)))
    score = _step("sft", TrainConfig(compiler_options=tw.FAST, mesh=ONE), model, mesh1)
    state = score.init_state(model)
    out = {}
    for key, b in (("rl", rl), ("pairs", pairs)):
        out[key] = b.replace(old_logp=np.asarray(score.outputs(state, b).logp) * b.loss_mask)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_each_registered_loss_lowers_its_loss(name, model, mesh1, fixed_batches):
    loss_cfg = ALGORITHM_DEFAULTS[name]
    if name == "gspo":  # its default clip (3e-4) stops the update after one step on a fixed batch
        loss_cfg = replace(loss_cfg, gspo_clip_low=0.2, gspo_clip_high=0.2)
    net = tw.tiny_model(value_head=True) if name == "ppo" else model
    # CISPO's value -sg(w) A logp has weights w = ratio that grow with the update, so it is
    # compared on-policy (old_logp recomputed each step: w = 1, the REINFORCE objective).
    cfg = TrainConfig(compiler_options=tw.FAST, loss=loss_cfg, mesh=ONE,
                      use_ref=name in ("dpo", "grpo", "reinforce_pp"),
                      old_logp="recompute" if name == "cispo" else "sampler")
    ts = _step(name, cfg, net, mesh1, lr=3e-3)
    state = ts.init_state(net)
    batch = fixed_batches["pairs" if name == "dpo" else "rl"]
    if name == "cispo":
        batch = batch.replace(old_logp=None)
    losses = []
    for _ in range(6):
        state, metrics = ts(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 1e-3, (name, losses)
    if name == "ppo":  # the critic was trained: values moved away from their zero init
        assert float(jnp.abs(ts.outputs(state, batch).values).max()) > 1e-4


# ---- PPO epochs and mini-batches ----
def test_epochs_and_mini_batches(model, batch, mesh1):
    cfg = TrainConfig(compiler_options=tw.FAST, loss=LossConfig(), mesh=ONE, ppo_epochs=2, num_mini_batches=2,
                      advantage="grpo",
                      old_logp="recompute")
    ts = _step("grpo", cfg, model, mesh1)
    state = ts.init_state(model, seed=1)
    before, rng = jax.device_get(state.params), np.asarray(state.rng)
    state, metrics = ts(state, batch)
    assert int(metrics["num_updates"]) == 4 and int(state.step) == 1
    assert not np.array_equal(np.asarray(state.rng), rng)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["ratio_mean"]) != 1.0  # later updates see a moved policy
    assert float(jnp.abs(state.params["wq"] - before["wq"]).max()) > 0
    assert int(state.opt_state[1][0].count) == 4  # four AdamW updates
    with pytest.raises(ValueError, match="mini-batches"):
        bad = _step("grpo", replace(cfg, num_mini_batches=3), model, mesh1)
        bad(bad.init_state(model), batch)
    # a KL weight with nothing to measure the KL against is an error, not a silent zero term
    with pytest.raises(ValueError, match="use_ref"):
        bad = _step("grpo", replace(cfg, loss=LossConfig(kl_coef=0.1)), model, mesh1)
        bad(bad.init_state(model), batch)


GROUP_LOSSES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo")


def test_every_loss_names_its_advantage_in_one_table():
    """Each registered loss names the advantage it reads, in one table; the group ones are
    exactly the losses that couple rows through `group_id`; the RL losses are those with one."""
    from jaxrl_agent.losses.registry import GROUP_ESTIMATORS, LOSS_ADVANTAGES, RL_LOSSES, advantage_of

    assert set(LOSS_ADVANTAGES) == set(LOSSES)
    assert {n for n, a in LOSS_ADVANTAGES.items() if a in GROUP_ESTIMATORS} == set(GROUP_LOSSES)
    assert set(RL_LOSSES) == set(LOSSES) - {"sft", "dpo"}
    assert advantage_of(LOSSES["dapo"]) == "grpo" and advantage_of(lambda o, b, c: (0.0, {})) is None


def _whole_batch_advantages(name, batch, loss_cfg):
    """The estimator of loss `name` on all rows at once, written out from the kernels."""
    from jaxrl_agent import advantages as adv_lib

    r, g, m = jnp.asarray(batch.reward), jnp.asarray(batch.group_id), jnp.asarray(batch.loss_mask)
    if name == "rloo":
        return adv_lib.broadcast(adv_lib.rloo(r, g), m)
    if name == "reinforce_pp":
        return adv_lib.reinforce_pp(jnp.asarray(batch.token_rewards), m, gamma=loss_cfg.gamma)
    if name == "ppo":  # no critic: values 0
        a, _ = adv_lib.gae(jnp.asarray(batch.token_rewards), jnp.zeros_like(m, jnp.float32), m,
                           gamma=loss_cfg.gamma, lam=loss_cfg.lam)
        return adv_lib.whiten(a, m)
    return adv_lib.broadcast(adv_lib.grpo(r, g, norm_by_std=loss_cfg.norm_by_std), m)


@pytest.mark.slow
@pytest.mark.parametrize("name", (*GROUP_LOSSES, "reinforce_pp", "ppo"))
def test_batch_estimators_see_the_whole_batch_across_mini_batches(name, model, batch, mesh1):
    """With the default advantage="loss" and shuffled mini-batches, an estimator whose value for
    a row depends on other rows (group statistics; REINFORCE++'s and PPO's whitening over the
    batch) sees the whole batch: the step equals the one given the advantages of the whole
    batch (the kernels on all rows, computed here), never those of the mini-batches."""
    loss_cfg = replace(ALGORITHM_DEFAULTS[name], kl_coef=0.0)
    if name == "gspo":  # its default clip (3e-4) would clip every token after the first update
        loss_cfg = replace(loss_cfg, gspo_clip_low=0.2, gspo_clip_high=0.2)
    cfg = TrainConfig(compiler_options=tw.FAST, loss=loss_cfg, mesh=ONE, num_mini_batches=4, advantage="loss")
    # graded rewards: with 0/1 ones every fragment's RLOO gradient can be one multiple of the
    # whole group's, which Adam's normalised update cannot tell apart
    reward = np.array([0.1, 0.9, 0.4, 0.0, 0.7, 0.2, 1.0, 0.3], np.float32)
    last = batch.loss_mask.shape[1] - 1 - np.argmax(batch.loss_mask[:, ::-1], axis=1)  # last policy token
    token_rewards = np.zeros(batch.loss_mask.shape, np.float32)
    token_rewards[np.arange(len(reward)), last] = reward
    batch = batch.replace(reward=reward, token_rewards=token_rewards)
    given = batch.replace(advantages=np.asarray(_whole_batch_advantages(name, batch, loss_cfg)))
    ts = _step(name, cfg, model, mesh1)
    s_loss, m_loss = ts(ts.init_state(model, seed=3), batch)
    s_given, m_given = ts(ts.init_state(model, seed=3), given)
    assert float(m_loss["update_norm"]) > 1e-6
    # 1e-5: the whitening here (eager) and in the step (jitted) may round one parameter apart;
    # mini-batch advantages move the update by orders of magnitude more
    _close(jax.device_get(s_loss.params), jax.device_get(s_given.params), atol=1e-5)


def test_ppo_critic_keeps_training_when_advantages_are_precomputed(batch, mesh1):
    """Advantages computed once over the whole batch (mini-batches, or TrainConfig.advantage=
    "gae") carry their value targets (`TrainBatch.returns`), so PPO's value loss still runs."""
    net = tw.tiny_model(value_head=True)
    for cfg in (TrainConfig(compiler_options=tw.FAST, loss=ALGORITHM_DEFAULTS["ppo"], mesh=ONE, num_mini_batches=2),
                TrainConfig(compiler_options=tw.FAST, loss=ALGORITHM_DEFAULTS["ppo"], mesh=ONE, advantage="gae")):
        ts = _step("ppo", cfg, net, mesh1)
        _, metrics = ts(ts.init_state(net), batch)
        assert "vf_loss" in metrics and float(metrics["vf_loss"]) > 0


# ---- precompiled buckets ----
def test_train_remat_recomputes_the_layers(model, mesh1):
    """`TrainConfig.remat` (gradient checkpointing) takes the same step with less scratch, on
    a copy of the model: the caller's model config stays as it was."""
    long = collate(tw.random_episodes(8, seed=6), TrajectoryConfig(buckets=(128,)))[0]
    runs = {}
    for remat in (False, True):
        cfg = TrainConfig(compiler_options=tw.FAST, mesh=ONE, remat=remat)
        ts = _step("grpo", cfg, model, mesh1)
        compiled = ts.precompile([long])[0].result()
        state, metrics = ts(ts.init_state(model), long)
        runs[remat] = (compiled.memory_analysis(), jax.device_get(state.params), float(metrics["loss"]))
    assert not model.config.remat
    assert abs(runs[True][2] - runs[False][2]) < 1e-6
    _close(runs[True][1], runs[False][1])
    if runs[False][0] is not None:
        assert runs[True][0].temp_size_in_bytes < 0.8 * runs[False][0].temp_size_in_bytes


def test_precompiled_step_is_the_jitted_step(model, batch, mesh1):
    """`precompile` (in its thread) builds the executable the first update runs, before the batch
    exists; it computes exactly what the lazily compiled step does, and a shape it was not
    given still goes to the ordinary jit."""
    cfg = TrainConfig(compiler_options=tw.FAST, loss=LossConfig(), mesh=ONE, num_mini_batches=2, advantage="grpo")
    lazy, early = _step("grpo", cfg, model, mesh1), _step("grpo", cfg, model, mesh1)
    pad = collate(tw.random_episodes(1, seed=0), TrajectoryConfig(buckets=(32,), row_buckets=(8,)))[0]
    (future,) = early.precompile([pad])
    assert early.precompile([pad]) == [future]  # one compile per shape
    s_lazy, m_lazy = lazy(lazy.init_state(model, seed=2), batch)
    s_early, m_early = early(early.init_state(model, seed=2), batch)
    assert future.done() and future.exception() is None
    assert early.step._cache_size() == 0  # the first update never went through the lazy jit
    _close(m_lazy, m_early, atol=0)
    _close(s_lazy.params, s_early.params, atol=0)
    other, _ = collate(tw.random_episodes(8, seed=6), TrajectoryConfig(buckets=(48,)))
    early(s_early, other)
    assert early.step._cache_size() == 1
    # a run that stops early drops the compiles not yet started; their shapes go to the jit
    queued = early.precompile([collate(tw.random_episodes(1), TrajectoryConfig(buckets=(t,), row_buckets=(8,)))[0]
                               for t in (64, 80, 96)])
    early.stop_precompiling()
    assert queued[-1].cancelled() and len(early._compiled) == 1 + sum(not f.cancelled() for f in queued)


# ---- LoRA ----
def test_lora_trains_adapters_only_and_base_is_the_reference(model, batch, mesh1):
    cfg = TrainConfig(compiler_options=tw.FAST, loss=LossConfig(kl_coef=0.1), mesh=ONE, use_ref=True,
                      lora=LoraConfig(rank=4, alpha=8.0))
    ts = _step("grpo", cfg, model, mesh1, lr=3e-2)
    state = ts.init_state(model)
    assert set(state.params) == set(LoraConfig().targets) and state.ref is None
    base = jax.device_get(state.frozen)
    _close(jax.device_get(ts.policy_params(state)), base, atol=0.0)  # B = 0: policy == base
    # the sampler reported exactly the trainer's log-probs: the measured gap is 0
    out = ts.outputs(state, batch)
    on_policy = batch.replace(sampler_logp=np.asarray(out.logp) * batch.loss_mask)
    state, m0 = ts(state, on_policy)
    assert float(m0["logp_gap_max"]) < 1e-5 and abs(float(m0["kl"])) < 1e-6
    assert float(m0["policy_tokens"]) == float(batch.loss_mask.sum())
    for _ in range(2):
        state, m = ts(state, on_policy)
    _close(jax.device_get(state.frozen), base, atol=0.0)  # the base never moves
    assert float(m["kl"]) > 0  # the policy moved away from the reference (= base)
    moved = jax.device_get(ts.policy_params(state))
    assert float(np.abs(moved["w_up"] - base["w_up"]).max()) > 1e-4
    np.testing.assert_array_equal(moved["embed"], base["embed"])  # not a LoRA target


def test_lora_delta_shapes_and_errors():
    base = {"wq": jnp.ones((2, 8, 4, 3)), "wo": jnp.ones((2, 4, 3, 8)), "w_down": jnp.ones((2, 16, 8))}
    cfg = LoraConfig(rank=2, targets=("wq", "wo", "w_down"))
    ad = lora_lib.init_lora(base, cfg, jax.random.key(0))
    assert ad["wq"]["a"].shape == (2, 8, 2) and ad["wq"]["b"].shape == (2, 2, 4, 3)
    assert ad["wo"]["a"].shape == (2, 4, 3, 2) and ad["wo"]["b"].shape == (2, 2, 8)
    ad["wo"]["b"] = jnp.ones_like(ad["wo"]["b"])
    merged = lora_lib.apply_lora(base, ad, cfg)
    want = np.einsum("lhkr,lrd->lhkd", np.asarray(ad["wo"]["a"]), np.ones((2, 2, 8))) * cfg.alpha / cfg.rank
    np.testing.assert_allclose(merged["wo"] - base["wo"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(merged["wq"], base["wq"])
    with pytest.raises(ValueError, match="rank"):
        lora_lib.init_lora(base, LoraConfig(rank=0), jax.random.key(0))
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        lora_lib.init_lora(base, LoraConfig(rank=2, targets=("embed",)), jax.random.key(0))


# ---- optimizer and config errors ----
def test_schedules_and_clipping():
    s = lr_schedule(OptimConfig(learning_rate=1.0, schedule="cosine", warmup_steps=10, total_steps=110,
                                min_lr_ratio=0.1))
    assert float(s(0)) == 0.0 and abs(float(s(5)) - 0.5) < 1e-6 and abs(float(s(10)) - 1.0) < 1e-6
    assert abs(float(s(60)) - 0.55) < 1e-6 and abs(float(s(110)) - 0.1) < 1e-6
    lin = lr_schedule(OptimConfig(learning_rate=2.0, schedule="linear", total_steps=4))
    assert [float(lin(i)) for i in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_schedule(OptimConfig(schedule="step"))
    opt = make_optimizer(OptimConfig(learning_rate=1.0, max_grad_norm=1.0, b1=0.0, b2=0.0, eps=0.0))
    g = {"w": jnp.asarray([30.0, 40.0])}
    upd, _ = opt.update(g, opt.init(g), {"w": jnp.zeros(2)})
    np.testing.assert_allclose(upd["w"], [-1.0, -1.0], rtol=1e-5)  # clipped, then Adam's sign step


def test_bad_train_configs(model, mesh1, batch):
    for bad, match in [({"old_logp": "behaviour"}, "old_logp"), ({"advantage": "vtrace"}, "unknown advantage"),
                       ({"ppo_epochs": 0}, ">= 1")]:
        with pytest.raises(ValueError, match=match):
            _step("grpo", TrainConfig(compiler_options=tw.FAST, mesh=ONE, **bad), model, mesh1)
    ts = _step("sft", TrainConfig(compiler_options=tw.FAST, mesh=ONE, num_micro_batches=3), model, mesh1)
    with pytest.raises(ValueError, match="micro-batches"):
        ts.grads(ts.init_state(model), batch)
