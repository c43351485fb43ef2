"""The LOSSES registry: every algorithm runs under jit on one batch, has finite gradients that
vanish on observation tokens, and composes the kernels the way its docstring says."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as ref
from jaxrl_agent import losses as L
from jaxrl_agent.config import LossConfig
from jaxrl_agent.structs import PolicyOutputs, TrainBatch
from test_advantages import random_mask

B, T = 8, 20


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    mask = random_mask(rng, B, T)
    mask[-1] = mask[0]  # every row has policy tokens (DPO pairs need them)
    last = np.zeros((B, T), np.float32)
    reward = rng.integers(0, 2, size=B).astype(np.float32)
    for b in range(B):
        idx = np.nonzero(mask[b])[0]
        last[b, idx[-1]] = reward[b]
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return TrainBatch(
        tokens=jnp.asarray(rng.integers(0, 50, size=(B, T)), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
        attention_mask=jnp.ones((B, T), jnp.int32),
        loss_mask=jnp.asarray(mask),
        sampler_logp=-jnp.abs(f(B, T)) * mask,
        turn_id=jnp.zeros((B, T), jnp.int32),
        token_rewards=jnp.asarray(last),
        group_id=jnp.asarray([0, 0, 0, 0, 1, 1, 1, 1], jnp.int32),
        reward=jnp.asarray(reward),
        ref_logp=-jnp.abs(f(B, T)),
        old_logp=-jnp.abs(f(B, T)),
        old_values=f(B, T),
    )


def outputs(logp, values):
    return PolicyOutputs(logp=logp, entropy=jnp.abs(logp) * 0.5, values=values)


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_every_loss_runs_jitted_with_masked_zero_grad(batch, name):
    cfg = replace(L.ALGORITHM_DEFAULTS[name], kl_coef=0.01, entropy_coef=0.01, tis_cap=2.0)
    fn = L.LOSSES[name]
    logp = -jnp.abs(jnp.asarray(np.random.default_rng(1).normal(size=(B, T)), jnp.float32))
    values = jnp.zeros((B, T))

    @jax.jit
    def f(lp, v):
        loss, metrics = fn(outputs(lp, v), batch, cfg)
        return loss, metrics

    (loss, metrics), (g_lp, g_v) = jax.jit(jax.value_and_grad(lambda lp, v: f(lp, v), argnums=(0, 1), has_aux=True))(logp, values)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
    g = np.asarray(g_lp)
    m = np.asarray(batch.loss_mask)
    assert np.all(np.isfinite(g)) and np.all(g[m == 0] == 0.0)
    assert np.any(g[m == 1] != 0.0), "the loss must depend on the policy tokens"
    if name == "ppo":
        assert np.any(np.asarray(g_v)[m == 1] != 0.0) and np.all(np.asarray(g_v)[m == 0] == 0.0)


def test_grpo_composes_group_advantage_clip_and_kl(batch):
    cfg = LossConfig(agg="token-mean", kl_coef=0.1, kl_kind="k3", entropy_coef=0.0)
    logp = batch.old_logp + 0.05
    loss, metrics = L.LOSSES["grpo"](outputs(logp, None), batch, cfg)
    m = np.asarray(batch.loss_mask)
    adv = ref.grpo(np.asarray(batch.reward), np.asarray(batch.group_id))[:, None] * m
    per = ref.ppo_per_token(np.asarray(logp), np.asarray(batch.old_logp), adv, 0.2, 0.2, 3.0)
    kl = ref.kl_penalty(np.asarray(logp), np.asarray(batch.ref_logp), "k3")
    expect = ref.aggregate(per, m, "token-mean") + 0.1 * ref.aggregate(kl, m, "token-mean")
    np.testing.assert_allclose(loss, expect, rtol=1e-5, atol=1e-6)


def test_dr_grpo_differs_from_grpo_and_dapo_drops_kl(batch):
    cfg = LossConfig(kl_coef=0.5)
    out = outputs(batch.old_logp, None)
    g = L.LOSSES["grpo"](out, batch, cfg)[0]
    d = L.LOSSES["dr_grpo"](out, batch, cfg)[0]
    assert not np.allclose(g, d)
    # at ratio 1 DAPO's loss is -mean(A) over tokens: no KL term whatever kl_coef says
    adv = ref.grpo(np.asarray(batch.reward), np.asarray(batch.group_id))[:, None] * np.asarray(batch.loss_mask)
    np.testing.assert_allclose(L.LOSSES["dapo"](out, batch, cfg)[0], ref.aggregate(-adv, np.asarray(batch.loss_mask), "token-mean"), rtol=1e-5, atol=1e-6)


def test_precomputed_advantages_take_precedence(batch):
    adv = jnp.ones((B, T)) * batch.loss_mask
    out = outputs(batch.old_logp, None)
    loss, _ = L.LOSSES["grpo"](out, replace(batch, advantages=adv), LossConfig(kl_coef=0.0))
    np.testing.assert_allclose(loss, -1.0, rtol=1e-6)


def test_dpo_pairs_rows(batch):
    out = outputs(batch.ref_logp, None)
    loss, metrics = L.LOSSES["dpo"](out, batch, LossConfig())
    np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)  # policy == reference
    with pytest.raises(ValueError, match="ref_logp"):
        L.LOSSES["dpo"](out, replace(batch, ref_logp=None), LossConfig())

