"""advantages.py against NumPy loop references, plus the stated invariants."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as ref
from jaxrl_agent import advantages as A

RTOL, ATOL = 1e-5, 1e-5


def random_mask(rng, B, T):
    """Prompt prefix, alternating policy / observation spans, padding, and one all-masked row."""
    mask = np.zeros((B, T), np.float32)
    for b in range(B - 1):
        length = rng.integers(T // 2, T + 1)
        t = rng.integers(0, 4)  # prompt
        policy = True
        while t < length:
            span = rng.integers(1, 6)
            if policy:
                mask[b, t : min(t + span, length)] = 1
            t += span
            policy = not policy
    return mask  # last row stays all-masked


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    B, T = 6, 40
    return dict(
        rewards=rng.normal(size=(B, T)).astype(np.float32),
        values=rng.normal(size=(B, T)).astype(np.float32),
        mask=random_mask(rng, B, T),
        scores=rng.normal(size=(9,)).astype(np.float32),
        group_id=np.array([7, 7, 7, 3, 3, 11, 5, 5, 5], np.int32),  # includes a group of one
    )


# Compiled once per module and shared by the tests below.
gae_scan = jax.jit(A.gae, static_argnames=("gamma", "lam", "method"))
grpo_j = jax.jit(A.grpo, static_argnames=("norm_by_std", "eps"))
rloo_j = jax.jit(A.rloo)


# ---- GAE ----
@pytest.mark.parametrize("method", ["scan", "associative"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_numpy(data, method, gamma, lam):
    adv, ret = gae_scan(data["rewards"], data["values"], data["mask"], gamma=gamma, lam=lam, method=method)
    adv_ref, ret_ref = ref.gae(data["rewards"], data["values"], data["mask"], gamma, lam)
    np.testing.assert_allclose(adv, adv_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ret, ret_ref, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(adv)[data["mask"] == 0] == 0)


def test_gae_scan_equals_associative_large():
    rng = np.random.default_rng(1)
    B, T = 8, 1024
    r, v = rng.normal(size=(2, B, T)).astype(np.float32)
    m = random_mask(rng, B, T)
    a1, r1 = gae_scan(r, v, m, gamma=0.99, lam=0.95, method="scan")
    a2, r2 = gae_scan(r, v, m, gamma=0.99, lam=0.95, method="associative")
    np.testing.assert_allclose(a1, a2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(r1, r2, rtol=1e-4, atol=1e-4)


def test_gae_masked_equals_compressed(data):
    """Masked GAE == GAE on the compressed sequence of policy tokens, row by row."""
    r, v, m = data["rewards"], data["values"], data["mask"]
    adv, _ = gae_scan(r, v, m, gamma=0.97, lam=0.9, method="scan")
    for b in range(r.shape[0]):
        keep = m[b] > 0
        if not keep.any():
            continue
        n = int(keep.sum())
        a_c, _ = A.gae(r[b, keep][None], v[b, keep][None], jnp.ones((1, n)), gamma=0.97, lam=0.9)
        np.testing.assert_allclose(np.asarray(adv)[b, keep], a_c[0], rtol=RTOL, atol=ATOL)


def test_gae_lambda1_gamma1_is_reward_to_go_minus_values(data):
    r, v, m = data["rewards"], data["values"], data["mask"]
    adv, ret = gae_scan(r, v, m, gamma=1.0, lam=1.0, method="scan")
    rtg = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)  # reward-to-go over policy tokens
    np.testing.assert_allclose(np.asarray(adv)[m > 0], (rtg - v)[m > 0], rtol=RTOL, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ret)[m > 0], rtg[m > 0], rtol=RTOL, atol=1e-4)


def test_gae_hand_computed():
    # policy tokens at t=0 and t=2, an observation at t=1 (its reward must be ignored).
    r = jnp.array([[0.0, 5.0, 1.0]])
    v = jnp.array([[0.5, 9.0, 0.25]])
    m = jnp.array([[1.0, 0.0, 1.0]])
    adv, ret = A.gae(r, v, m, gamma=0.5, lam=0.5)
    d2 = 1.0 + 0.5 * 0.0 - 0.25  # 0.75
    d0 = 0.0 + 0.5 * 0.25 - 0.5  # -0.375
    np.testing.assert_allclose(adv, [[d0 + 0.25 * d2, 0.0, d2]], atol=1e-7)
    np.testing.assert_allclose(ret, [[d0 + 0.25 * d2 + 0.5, 0.0, 1.0]], atol=1e-7)


def test_gae_mask_vs_slice(data):
    """Trailing padding does not change anything: mask == 0 tail == sliced off."""
    r, v, m = data["rewards"], data["values"], data["mask"].copy()
    m[:, 30:] = 0
    full, _ = gae_scan(r, v, m, gamma=0.99, lam=0.95, method="scan")
    sliced, _ = A.gae(r[:, :30], v[:, :30], m[:, :30], gamma=0.99, lam=0.95)
    np.testing.assert_allclose(np.asarray(full)[:, :30], sliced, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_gae_finite_gradients(data, method):
    def f(r, v):
        adv, ret = A.gae(r, v, data["mask"], gamma=0.99, lam=0.95, method=method)
        return jnp.sum(adv**2) + jnp.sum(ret)

    grads = jax.grad(f, argnums=(0, 1))(jnp.asarray(data["rewards"]), jnp.asarray(data["values"]))
    for g in grads:
        assert np.all(np.isfinite(g))
        assert np.all(np.asarray(g)[data["mask"] == 0] == 0)


def _nan_rows(x):
    return [np.flatnonzero(np.isnan(row)).tolist() for row in np.asarray(x)]


def test_gae_nan_reward_on_a_policy_token_propagates(data):
    """The scan marks observation tokens with a NaN bit pattern in the rewards; a NaN reward,
    or one that carries exactly that pattern, on a policy token must still poison the policy
    tokens before it, as in the associative form, never pass for an observation token."""
    r, v, m = data["rewards"].copy(), data["values"], data["mask"]
    b, t = 0, int(np.flatnonzero(m[0])[-1])  # last policy token of row 0
    _, marker_bits = A._OBSERVATION_BITS[np.dtype(np.float32)]  # the scan's own pattern
    for bad in (np.float32(np.nan), np.array([marker_bits], np.uint32).view(np.float32)[0]):
        r[b, t] = bad
        scan_adv, _ = gae_scan(r, v, m, gamma=0.99, lam=0.95, method="scan")
        assoc_adv, _ = gae_scan(r, v, m, gamma=0.99, lam=0.95, method="associative")
        want = [np.flatnonzero(m[b, : t + 1]).tolist()] + [[]] * (r.shape[0] - 1)
        assert _nan_rows(scan_adv) == want  # every policy token up to t, nothing else
        assert _nan_rows(np.where(m > 0, assoc_adv, 0.0)) == want


def test_gae_float64_matches_numpy(data):
    with jax.enable_x64(True):
        r, v, m = (np.asarray(data[k], np.float64) for k in ("rewards", "values", "mask"))
        adv, ret = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=0.99, lam=0.95)
        assert adv.dtype == jnp.float64
        adv_ref, ret_ref = ref.gae(r, v, m, 0.99, 0.95)
        np.testing.assert_allclose(adv, adv_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret, ret_ref, rtol=1e-12, atol=1e-12)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match="values"):
        A.gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="method"):
        A.gae(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)), gamma=1.0, lam=1.0, method="loop")


# ---- whiten ----
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_numpy(data, shift_mean):
    out = jax.jit(A.whiten, static_argnames="shift_mean")(data["rewards"], data["mask"], shift_mean=shift_mean)
    np.testing.assert_allclose(out, ref.whiten(data["rewards"], data["mask"], shift_mean), rtol=1e-4, atol=1e-5)


def test_whiten_unbiased_variance():
    x = jnp.array([[1.0, 2.0, 3.0, 100.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    out = A.whiten(x, m)
    # mean 2, unbiased var 1 -> (x - 2) / 1
    np.testing.assert_allclose(out, [[-1.0, 0.0, 1.0, 0.0]], atol=1e-6)


# ---- group advantages ----
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_numpy(data, norm_by_std):
    out = grpo_j(data["scores"], data["group_id"], norm_by_std=norm_by_std)
    np.testing.assert_allclose(out, ref.grpo(data["scores"], data["group_id"], norm_by_std), rtol=RTOL, atol=ATOL)


def test_grpo_hand_computed():
    s = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5])
    g = jnp.array([0, 0, 0, 0, 9])
    out = A.grpo(s, g, eps=0.0)
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(out, [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.5], rtol=1e-6)
    # identical rewards in a group give 0 (no signal), not NaN
    np.testing.assert_allclose(A.grpo(jnp.ones(4), jnp.zeros(4, jnp.int32)), 0.0, atol=0)


def test_rloo_matches_numpy(data):
    np.testing.assert_allclose(rloo_j(data["scores"], data["group_id"]), ref.rloo(data["scores"], data["group_id"]), rtol=RTOL, atol=ATOL)


def test_grpo_passk_matches_numpy():
    s = np.array([0.0, 1.0, 1.0, 0.2, 0.3, 0.9, 5.0], np.float32)
    g = np.array([1, 1, 1, 2, 2, 2, 3], np.int32)
    out = jax.jit(A.grpo_passk)(s, g)
    np.testing.assert_allclose(out, ref.grpo_passk(s, g), atol=1e-7)
    np.testing.assert_allclose(out, [0.0, 0.0, 0.0, 0.0, 0.0, 0.6, 0.0], atol=1e-6)


def test_group_ids_are_labels_not_indices(data):
    """Relabelling groups (any int32 values) changes nothing."""
    g2 = (data["group_id"].astype(np.int64) * 1000 - 7).astype(np.int32)
    np.testing.assert_allclose(grpo_j(data["scores"], g2), grpo_j(data["scores"], data["group_id"]), atol=1e-7)


# ---- REINFORCE++ and broadcast ----
def test_reinforce_pp_matches_numpy(data):
    out = jax.jit(A.reinforce_pp, static_argnames=("gamma", "method"))(data["rewards"], data["mask"], gamma=0.95)
    np.testing.assert_allclose(out, ref.reinforce_pp(data["rewards"], data["mask"], 0.95), rtol=1e-4, atol=1e-4)


def test_reinforce_pp_baseline_matches_numpy(data):
    rng = np.random.default_rng(3)
    B, T = 9, 12
    mask = random_mask(rng, B, T)
    out = jax.jit(A.reinforce_pp_baseline)(data["scores"], data["group_id"], mask)
    np.testing.assert_allclose(out, ref.reinforce_pp_baseline(data["scores"], data["group_id"], mask), rtol=1e-4, atol=1e-5)


def test_broadcast(data):
    adv = jnp.arange(data["mask"].shape[0], dtype=jnp.float32)
    out = A.broadcast(adv, data["mask"])
    np.testing.assert_array_equal(out, np.arange(6)[:, None] * data["mask"])
    with pytest.raises(ValueError):
        A.broadcast(adv[:3], data["mask"])
