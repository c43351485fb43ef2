"""losses/ kernels against NumPy references, hand cases and the stated invariants."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_advantages import random_mask

import np_reference as ref
from jaxrl_agent import losses as L

MODES = L.AGG_MODES
KINDS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    B, T = 6, 24
    return dict(
        logp=(-rng.uniform(0.05, 3.0, size=(B, T))).astype(np.float32),
        old_logp=(-rng.uniform(0.05, 3.0, size=(B, T))).astype(np.float32),
        adv=rng.normal(size=(B, T)).astype(np.float32),
        x=rng.normal(size=(B, T)).astype(np.float32),
        mask=random_mask(rng, B, T),
    )


agg_j = jax.jit(L.aggregate, static_argnames=("mode", "horizon"))
ppo_j = jax.jit(L.ppo_policy_loss, static_argnames=("clip_low", "clip_high", "dual_clip", "agg", "horizon"))


# ---- aggregate ----
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_numpy(data, mode):
    np.testing.assert_allclose(agg_j(data["x"], data["mask"], mode=mode), ref.aggregate(data["x"], data["mask"], mode), rtol=1e-5, atol=1e-6)


def test_aggregate_hand_computed():
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(L.aggregate(x, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(L.aggregate(x, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(L.aggregate(x, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(L.aggregate(x, m, "seq-mean-token-sum-norm")) == pytest.approx((6 + 4) / 2 / 3)
    assert float(L.aggregate(x, jnp.zeros_like(m), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="aggregation mode"):
        L.aggregate(x, m, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregate_mask_vs_slice(data, mode):
    """Padding columns with mask 0 are the same as slicing them off."""
    m = data["mask"].copy()
    m[:, 18:] = 0
    full = L.aggregate(data["x"], m, mode)
    sliced = L.aggregate(data["x"][:, :18], m[:, :18], mode)
    np.testing.assert_allclose(full, sliced, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 11), min_size=0, max_size=5, unique=True),
       mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_accumulated_parts_equal_full_batch(cuts, mode, seed):
    """Summing (num, den) over random row splits == aggregate on the whole batch."""
    rng = np.random.default_rng(seed)
    B, T = 12, 10
    x = rng.normal(size=(B, T)).astype(np.float32)
    m = (rng.uniform(size=(B, T)) < 0.5).astype(np.float32)
    m[rng.integers(0, B)] = 0  # an all-masked row
    bounds = [0, *sorted(cuts), B]
    num = den = 0.0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n, d = L.aggregate_parts(jnp.asarray(x[lo:hi]), jnp.asarray(m[lo:hi]), mode, horizon=T)
        num, den = num + float(n), den + float(d)
    full = float(L.aggregate(jnp.asarray(x), jnp.asarray(m), mode))
    assert num / max(den, 1.0) == pytest.approx(full, rel=1e-5, abs=1e-6)


# ---- KL ----
@pytest.mark.parametrize("kind", KINDS)
def test_kl_matches_numpy_and_is_zero_at_ref(data, kind):
    out = jax.jit(L.kl_penalty, static_argnames="kind")(data["logp"], data["old_logp"], kind=kind)
    np.testing.assert_allclose(out, ref.kl_penalty(data["logp"], data["old_logp"], kind), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(L.kl_penalty(data["logp"], data["logp"], kind), 0.0)


def test_kl_k3_clamps():
    big = L.kl_penalty(jnp.array([[-100.0]]), jnp.array([[0.0]]), "k3")
    assert float(big[0, 0]) == 10.0  # exp(20) - 21 clamped to 10
    with pytest.raises(ValueError, match="KL estimator"):
        L.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "k4")


def test_kl_k3_is_nonnegative_and_unbiased_in_expectation():
    """E_{x~pi}[k3] estimates KL(pi||ref): check on an explicit categorical."""
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    lp, lq = np.log(p)[None], np.log(q)[None]
    est = (p * np.asarray(L.kl_penalty(jnp.asarray(lp), jnp.asarray(lq), "k3"))).sum()
    assert est == pytest.approx((p * np.log(p / q)).sum(), rel=1e-5)
    assert np.all(np.asarray(L.kl_penalty(jnp.asarray(lp), jnp.asarray(lq), "k3")) >= 0)


# ---- PPO ----
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("clip_high", [0.2, 0.28])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_matches_numpy(data, dual_clip, clip_high, mode):
    loss, metrics = ppo_j(data["logp"], data["old_logp"], data["adv"], data["mask"], clip_low=0.2,
                          clip_high=clip_high, dual_clip=dual_clip, agg=mode)
    per_tok = ref.ppo_per_token(data["logp"], data["old_logp"], data["adv"], 0.2, clip_high, dual_clip)
    np.testing.assert_allclose(loss, ref.aggregate(per_tok, data["mask"], mode), rtol=1e-5, atol=1e-6)
    assert set(metrics) >= {"clipfrac", "clipfrac_lower", "approx_kl"}


def test_ppo_hand_computed_clips():
    lr = np.log([1.5, 0.5, 5.0, 1.0])
    logp = jnp.asarray(lr[None], jnp.float32)
    old = jnp.zeros_like(logp)
    adv = jnp.array([[1.0, -1.0, -1.0, 2.0]])
    m = jnp.ones_like(adv)
    loss, met = L.ppo_policy_loss(logp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # tok0: A>0, ratio 1.5 clipped at 1.28 -> -1.28; tok1: A<0, ratio .5 -> max(.5,.8)=.8;
    # tok2: A<0, ratio 5 -> max(5, 1.28)=5 then dual-clip min(5, 3)=3; tok3: ratio 1 -> -2.
    np.testing.assert_allclose(loss, (-1.28 + 0.8 + 3.0 - 2.0) / 4, rtol=1e-6)
    np.testing.assert_allclose(met["clipfrac"], 2 / 4)  # tok0 and tok1 took the clipped branch
    np.testing.assert_allclose(met["clipfrac_lower"], 1 / 4)  # tok2


def test_ppo_ratio_one_is_plain_policy_gradient(data):
    """At logp == old_logp the PPO gradient is exactly the REINFORCE gradient."""
    m, a = data["mask"], data["adv"]
    for mode in MODES:
        g_ppo = jax.grad(lambda lp: L.ppo_policy_loss(lp, jax.lax.stop_gradient(lp), a, m, agg=mode)[0])(jnp.asarray(data["logp"]))
        g_pg = jax.grad(lambda lp: L.aggregate(-a * lp, m, mode))(jnp.asarray(data["logp"]))
        np.testing.assert_allclose(g_ppo, g_pg, rtol=1e-6, atol=1e-7)


def test_ppo_shape_and_arg_errors(data):
    with pytest.raises(ValueError, match="shape mismatch"):
        L.ppo_policy_loss(data["logp"], data["old_logp"][:, :3], data["adv"], data["mask"])
    with pytest.raises(ValueError, match="dual_clip"):
        L.ppo_policy_loss(data["logp"], data["old_logp"], data["adv"], data["mask"], dual_clip=0.5)


# ---- GSPO / CISPO ----
def test_gspo_value_and_gradient_at_ratio_one(data):
    m, a = data["mask"], data["adv"]
    lp = jnp.asarray(data["logp"])
    loss, _ = L.gspo_policy_loss(lp, lp, a, m)
    np.testing.assert_allclose(loss, ref.aggregate(-a, m, "seq-mean-token-mean"), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda x: L.gspo_policy_loss(x, jax.lax.stop_gradient(x), a, m)[0])(lp)
    g_pg = jax.grad(lambda x: L.aggregate(-a * x, m, "seq-mean-token-mean"))(lp)
    np.testing.assert_allclose(g, g_pg, rtol=1e-5, atol=1e-7)


def test_gspo_uses_sequence_ratio():
    # one sequence, two tokens with log-ratios +0.5 and -0.5: sequence ratio is exactly 1,
    # so nothing is clipped even though each token ratio is far outside the clip range.
    logp = jnp.array([[0.5, -0.5]]) - 1.0
    old = jnp.array([[0.0, 0.0]]) - 1.0
    adv = jnp.ones((1, 2))
    loss, met = L.gspo_policy_loss(logp, old, adv, jnp.ones((1, 2)))
    np.testing.assert_allclose(loss, -1.0, rtol=1e-6)
    assert float(met["clipfrac"]) == 0.0


def test_cispo_matches_numpy(data):
    lp, old, a, m = (data[k] for k in ("logp", "old_logp", "adv", "mask"))
    loss, met = L.cispo_policy_loss(jnp.asarray(lp), jnp.asarray(old), a, m, clip_high=0.5)
    w = np.minimum(np.exp(lp - old), 1.5)
    np.testing.assert_allclose(loss, ref.aggregate(-w * a * lp, m, "token-mean"), rtol=1e-5, atol=1e-6)
    # the weight is a constant: gradient is -w A / n on policy tokens, even where clipped
    g = jax.grad(lambda x: L.cispo_policy_loss(x, jnp.asarray(old), a, m, clip_high=0.5)[0])(jnp.asarray(lp))
    np.testing.assert_allclose(g, -w * a * m / m.sum(), rtol=1e-5, atol=1e-7)


# ---- value, entropy, SFT, DPO ----
def test_value_loss_matches_numpy(data):
    v, old, ret, m = data["x"], data["adv"], data["logp"], data["mask"]
    loss, met = L.value_loss(v, old, ret, m, cliprange_value=0.2)
    vclip = old + np.clip(v - old, -0.2, 0.2)
    per = 0.5 * np.maximum((v - ret) ** 2, (vclip - ret) ** 2)
    np.testing.assert_allclose(loss, ref.aggregate(per, m, "token-mean"), rtol=1e-5)
    loss_nc, _ = L.value_loss(v, old, ret, m, cliprange_value=None)
    np.testing.assert_allclose(loss_nc, ref.aggregate(0.5 * (v - ret) ** 2, m, "token-mean"), rtol=1e-5)
    assert 0.0 <= float(met["vf_clipfrac"]) <= 1.0


def test_sft_and_entropy(data):
    np.testing.assert_allclose(L.sft_loss(data["logp"], data["mask"]), ref.aggregate(-data["logp"], data["mask"], "token-mean"), rtol=1e-6)
    np.testing.assert_allclose(L.entropy_bonus(data["x"], data["mask"], "seq-mean-token-mean"), ref.aggregate(data["x"], data["mask"], "seq-mean-token-mean"), rtol=1e-5)


@pytest.mark.parametrize("kind,ls", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_matches_numpy(kind, ls):
    rng = np.random.default_rng(5)
    c, r, rc, rr = rng.normal(size=(4, 7)).astype(np.float32) * 3
    loss, met = jax.jit(L.dpo_loss, static_argnames=("beta", "kind", "label_smoothing"))(c, r, rc, rr, beta=0.5, kind=kind, label_smoothing=ls)
    h = (c - r) - (rc - rr)
    logsig = lambda z: -np.log1p(np.exp(-z))  # noqa: E731
    if kind == "sigmoid":
        expect = np.mean(-(1 - ls) * logsig(0.5 * h) - ls * logsig(-0.5 * h))
    else:
        expect = np.mean((h - 1.0) ** 2)
    np.testing.assert_allclose(loss, expect, rtol=1e-5)
    np.testing.assert_allclose(met["reward_accuracy"], np.mean(h > 0), rtol=1e-6)


def test_dpo_hand_case_and_errors():
    z = jnp.zeros(3)
    np.testing.assert_allclose(L.dpo_loss(z, z, z, z)[0], np.log(2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="DPO kind"):
        L.dpo_loss(z, z, z, z, kind="hinge2")
    with pytest.raises(ValueError, match="four"):
        L.dpo_loss(z, z[:2], z, z)


# ---- masked tokens get exactly zero gradient, for every kernel ----
@pytest.mark.parametrize("name", ["ppo", "ppo_tis", "gspo", "cispo", "sft", "entropy", "kl"])
def test_zero_gradient_on_masked_tokens(data, name):
    a, m, old = data["adv"], data["mask"], jnp.asarray(data["old_logp"])
    w = jnp.asarray(np.abs(data["x"]))
    fns = {
        "ppo": lambda x: L.ppo_policy_loss(x, old, a, m)[0],
        "ppo_tis": lambda x: L.ppo_policy_loss(x, old, a, m, is_weights=w, agg="seq-mean-token-sum")[0],
        "gspo": lambda x: L.gspo_policy_loss(x, old, a, m)[0],
        "cispo": lambda x: L.cispo_policy_loss(x, old, a, m)[0],
        "sft": lambda x: L.sft_loss(x, m),
        "entropy": lambda x: L.entropy_bonus(x, m),
        "kl": lambda x: L.aggregate(L.kl_penalty(x, old, "k3"), m),
    }
    g = np.asarray(jax.grad(fns[name])(jnp.asarray(data["logp"])))
    assert np.all(np.isfinite(g))
    assert np.all(g[m == 0] == 0.0)
    assert np.any(g[m == 1] != 0.0)
