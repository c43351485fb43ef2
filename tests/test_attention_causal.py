"""The causal attention of training (`layers.attention(causal=True)`: query blocks that skip
the keys after their last query) against the plain masked softmax attention over all keys:
outputs and the gradients of q, k and v (a reference for any rewrite of its backward pass)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent.model.layers import MASKED, attention


def _reference(q, k, v, mask):
    """Masked softmax attention over all S keys, GQA by repeating k / v (autodiff'd)."""
    b, t, h, dh = q.shape
    g = h // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dh)
    s = jnp.where(mask[:, None], s, MASKED)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _inputs(seed, b, t, s, h=4, kv=2, dh=8, pad_rows=()):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, t, h, dh), (b, s, kv, dh), (b, s, kv, dh)))
    before = s - t
    allowed = np.arange(s)[None, :] <= before + np.arange(t)[:, None]  # causal, after a prefix
    mask = np.broadcast_to(allowed, (b, t, s)).copy()
    mask &= rng.random((b, 1, s)) > 0.15  # some keys hidden (packed segments, padding)
    for r in pad_rows:
        mask[:, r] = False  # a query that sees no key: a uniform softmax, never NaN
    return q, k, v, jnp.asarray(mask)


@pytest.mark.parametrize("b,t,s,pad_rows", [(2, 96, 96, ()), (3, 200, 200, (5, 199)), (2, 130, 162, (0,))])
def test_outputs_and_gradients_match_autodiff(b, t, s, pad_rows):
    """T=96: blocks of 64 and 32; T=200: 8 blocks of 25 -> 64-query blocks; S > T: a shared
    prefix of keys before the queries' own."""
    q, k, v, mask = _inputs(b * t + s, b, t, s, pad_rows=pad_rows)
    # A query that sees no key is padding: its output is garbage nobody reads (uniform over
    # its block's keys here, over all keys in the reference), so it is compared for being
    # finite only and gets no cotangent.
    seen = np.asarray(mask).any(-1)  # [B, T]
    cot = np.random.default_rng(1).normal(size=q.shape) * seen[:, :, None, None]
    cot = jnp.asarray(cot, jnp.float32)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cot)

    ours = lambda q, k, v: attention(q, k, v, mask, causal=True)  # noqa: E731
    ref = lambda q, k, v: _reference(q, k, v, mask)  # noqa: E731
    out = np.asarray(ours(q, k, v))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[seen], np.asarray(ref(q, k, v))[seen], atol=2e-5, rtol=2e-5)
    g_ours = jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, v)
    for name, a, r in zip("qkv", g_ours, g_ref):
        np.testing.assert_allclose(a, r, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
        assert np.isfinite(np.asarray(a)).all()

