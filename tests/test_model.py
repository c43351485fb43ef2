"""Tests for model/ (decoder.py, kv_cache.py, logprobs.py): forward, padding, KV cache, chunked log-probs, metadata."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_agent.model import kv_cache
from jaxrl_agent.model.decoder import CausalLM, ModelConfig
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.model.logprobs import logp_and_entropy_from_logits, token_logprobs_and_entropy

CFG = ModelConfig(
    vocab_size=131, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, rope_theta=1000.0, qkv_bias=True, o_bias=True, qk_norm=True, value_head=True,
)
B, T = 3, 12


def _params(model):
    return list(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _perturbed(cfg, seed=0, dtype=jnp.float32):
    """A model whose norms/biases are not at their trivial init, so every parameter matters."""
    model = CausalLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    key = jax.random.key(seed + 100)
    for i, ((name,), var) in enumerate(_params(model)):
        noise = 0.1 * jax.random.normal(jax.random.fold_in(key, i), var.shape)
        getattr(model, name).set_value((var[...].astype(jnp.float32) + noise).astype(dtype))
    return model


@pytest.fixture(scope="module")
def model():
    return _perturbed(CFG)


@pytest.fixture(scope="module")
def fns(model):
    """Jitted pure functions over the split model, compiled once for the module."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, tok, pos, am: nnx.merge(graphdef, s)(tok, pos, am))
    outs = jax.jit(lambda s, tok, pos, am: policy_outputs(nnx.merge(graphdef, s), tok, pos, am, chunk_size=5))
    prefill = jax.jit(lambda s, tok, c, valid: nnx.merge(graphdef, s).prefill(tok, c, valid))
    decode = jax.jit(lambda s, tok, c, active: nnx.merge(graphdef, s).decode_step(tok, c, active))
    return dict(state=state, fwd=fwd, outs=outs, prefill=prefill, decode=decode)


def _batch(seed=0, b=B, t=T):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return tokens, positions, jnp.ones((b, t), jnp.int32)


def test_forward_shapes_and_dtype(fns):
    logits = fns["fwd"](fns["state"], *_batch())
    assert logits.shape == (B, T, CFG.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_causality_and_padding(fns):
    """Future tokens do not change past logits; a left-padded row with explicit positions and
    a right-padded row give the unpadded row's logits on their real tokens."""
    tokens, positions, mask = _batch(1, b=1, t=8)
    ref = fns["fwd"](fns["state"], tokens, positions, mask)[0]
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % CFG.vocab_size)
    out = fns["fwd"](fns["state"], changed, positions, mask)[0]
    np.testing.assert_array_equal(np.asarray(out[:6]), np.asarray(ref[:6]))
    assert float(jnp.abs(out[6] - ref[6]).max()) > 1e-3

    pad = 4
    left_tok = jnp.concatenate([jnp.full((1, pad), 7, jnp.int32), tokens], 1)
    left_pos = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), positions], 1)
    left_mask = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), mask], 1)
    right_tok = jnp.concatenate([tokens, jnp.full((1, pad), 9, jnp.int32)], 1)
    right_pos = jnp.concatenate([positions, jnp.arange(8, 8 + pad, dtype=jnp.int32)[None]], 1)
    right_mask = jnp.concatenate([mask, jnp.zeros((1, pad), jnp.int32)], 1)
    both = fns["fwd"](
        fns["state"], jnp.concatenate([left_tok, right_tok]), jnp.concatenate([left_pos, right_pos]),
        jnp.concatenate([left_mask, right_mask]),
    )
    assert bool(jnp.all(jnp.isfinite(both)))  # fully masked (padded) queries stay finite
    np.testing.assert_allclose(both[0, pad:], ref, atol=1e-5)
    np.testing.assert_allclose(both[1, :8], ref, atol=1e-5)


def test_packed_row_equals_separate_rows(fns):
    """attention_mask may carry segment ids (1, 2, ...): a packed row attends within segments."""
    tokens, positions, mask = _batch(9, b=1, t=8)
    packed_mask = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]], jnp.int32)
    packed_pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]], jnp.int32)
    packed = fns["fwd"](fns["state"], tokens, packed_pos, packed_mask)[0]
    first = fns["fwd"](fns["state"], tokens, positions, (jnp.arange(8) < 3).astype(jnp.int32)[None])[0]
    second_tok = jnp.concatenate([tokens[:, 3:7], tokens[:, :4]], 1)
    second = fns["fwd"](fns["state"], second_tok, positions, (jnp.arange(8) < 4).astype(jnp.int32)[None])[0]
    np.testing.assert_allclose(packed[:3], first[:3], atol=1e-5)
    np.testing.assert_allclose(packed[3:7], second[:4], atol=1e-5)


@pytest.mark.parametrize("layers", ["unrolled", "scanned"])
def test_cached_decode_matches_full_forward(fns, model, layers):
    """Prefill rows of different lengths, decode step by step, prefill a second (observation)
    chunk, decode again: every cached logit equals the full forward's at that position. Both
    cache forms: per-layer arrays (unrolled layers) and one stacked array (scanned layers)."""
    s_total = 24
    tokens, positions, mask = _batch(2, t=s_total)
    full = np.asarray(fns["fwd"](fns["state"], tokens, positions, mask))
    rows = np.arange(B)
    if layers == "scanned":  # the same weights, layers run by lax.scan over a stacked cache
        scanned = _perturbed(dataclasses.replace(CFG, unroll_layers=0))
        graphdef, state = nnx.split(scanned)
        fns = dict(state=state,
                   prefill=jax.jit(lambda s, tok, c, valid: nnx.merge(graphdef, s).prefill(tok, c, valid)),
                   decode=jax.jit(lambda s, tok, c, active: nnx.merge(graphdef, s).decode_step(tok, c, active)))
        model = scanned
    cache = model.init_cache(B, 32)
    assert cache.per_layer == (layers == "unrolled")

    def prefill_chunk(cache, lens, width):
        start = np.asarray(cache.lengths)
        chunk = np.zeros((B, width), np.int32)
        valid = (np.arange(width)[None, :] < np.asarray(lens)[:, None]).astype(np.int32)
        for b in range(B):
            chunk[b, : lens[b]] = np.asarray(tokens[b, start[b] : start[b] + lens[b]])
        logits, cache = fns["prefill"](fns["state"], jnp.asarray(chunk), cache, jnp.asarray(valid))
        np.testing.assert_array_equal(np.asarray(cache.lengths), start + np.asarray(lens))
        for b in range(B):
            np.testing.assert_allclose(logits[b], full[b, start[b] + lens[b] - 1], atol=2e-5)
        return cache

    def decode(cache, steps, active):
        for _ in range(steps):
            before = np.asarray(cache.lengths)
            nxt = jnp.asarray(np.asarray(tokens)[rows, np.minimum(before, s_total - 1)])
            logits, cache = fns["decode"](fns["state"], nxt, cache, jnp.asarray(active))
            after = np.asarray(cache.lengths)
            np.testing.assert_array_equal(after, before + active)
            for b in np.flatnonzero(active):
                np.testing.assert_allclose(logits[b], full[b, before[b]], atol=2e-5)
        return cache

    cache = prefill_chunk(cache, [3, 7, 5], width=7)
    cache = decode(cache, 4, np.array([1, 1, 1], np.int32))
    cache = decode(cache, 2, np.array([1, 0, 1], np.int32))  # row 1 finished: it stands still
    cache = prefill_chunk(cache, [4, 1, 6], width=6)  # tool observations of different lengths
    decode(cache, 3, np.array([1, 1, 1], np.int32))


def test_cache_writes_past_capacity_are_dropped_not_clamped():
    """A right-padded chunk that overhangs the cache end must not overwrite valid slots."""
    filled = jnp.arange(16, dtype=jnp.float32).reshape(2, 1, 1, 4, 2)  # stacked [L, B, K, S, Dh]
    new = jnp.full((1, 3, 1, 2), -1.0)  # [B, T, K, Dh]
    slots = kv_cache.append_slots(jnp.array([3], jnp.int32), 3)  # slots 3, 4, 5 of a 4-slot row
    out = kv_cache.write_slots(filled, slots, new, jnp.int32(1))
    np.testing.assert_array_equal(out[0], filled[0])  # the other layer is untouched
    np.testing.assert_array_equal(out[1, 0, 0, :3], filled[1, 0, 0, :3])
    np.testing.assert_array_equal(out[1, 0, 0, 3], new[0, 0, 0])
    one = kv_cache.write_slots(filled[1], slots, new)  # one layer's [B, K, S, Dh] array
    np.testing.assert_array_equal(one, out[1])
    # Keys keep slots last ([B, K, Dh, S]): the same write, transposed.
    keys = kv_cache.write_slots(filled.swapaxes(-1, -2), slots, new, jnp.int32(1), slots_last=True)
    np.testing.assert_array_equal(keys, out.swapaxes(-1, -2))
    keys_one = kv_cache.write_slots(filled[1].swapaxes(-1, -2), slots, new, slots_last=True)
    np.testing.assert_array_equal(keys_one, out[1].swapaxes(-1, -2))
    for per_layer in (False, True):
        assert kv_cache.init_cache(2, 1, 4, 1, 2, per_layer=per_layer).capacity == 4


@pytest.mark.parametrize("per_layer", [True, False])
def test_cache_window_view_round_trips(per_layer):
    """`window` keeps the first w slots of keys (slots last) and values (slots before Dh);
    `put_window` writes a changed view back and leaves the slots past w as they were."""
    rng = np.random.default_rng(0)
    cache = kv_cache.init_cache(2, 3, 8, 2, 4, per_layer=per_layer)
    fill = lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype)  # noqa: E731
    cache = cache.replace(k=jax.tree.map(fill, cache.k), v=jax.tree.map(fill, cache.v), lengths=jnp.array([1, 2, 3]))
    view = kv_cache.window(cache, 5)
    assert view.capacity == 5 and kv_cache.window(cache, 8) is cache
    for full, cut in zip(jax.tree.leaves(cache.k), jax.tree.leaves(view.k)):
        np.testing.assert_array_equal(cut, full[..., :5])
    for full, cut in zip(jax.tree.leaves(cache.v), jax.tree.leaves(view.v)):
        np.testing.assert_array_equal(cut, full[..., :5, :])
    changed = view.replace(k=jax.tree.map(lambda a: a + 1, view.k), v=jax.tree.map(lambda a: a - 1, view.v),
                           lengths=view.lengths + 1)
    back = kv_cache.put_window(cache, changed)
    assert back.capacity == 8 and back.lengths.tolist() == [2, 3, 4]
    for old, new in zip(jax.tree.leaves(cache.k), jax.tree.leaves(back.k)):
        np.testing.assert_array_equal(new[..., :5], old[..., :5] + 1)
        np.testing.assert_array_equal(new[..., 5:], old[..., 5:])
    for old, new in zip(jax.tree.leaves(cache.v), jax.tree.leaves(back.v)):
        np.testing.assert_array_equal(new[..., :5, :], old[..., :5, :] - 1)
        np.testing.assert_array_equal(new[..., 5:, :], old[..., 5:, :])


@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize("w", [5, 8])
def test_cache_window_of_some_rows_round_trips(per_layer, w):
    """`window(cache, w, rows)` is rows `rows` (in that order) of the first w slots, the whole
    cache included (w = S); `put_window(..., rows)` writes them back and leaves every other
    row, and the slots past w, as they were."""
    rng = np.random.default_rng(1)
    cache = kv_cache.init_cache(2, 4, 8, 2, 4, per_layer=per_layer)
    fill = lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype)  # noqa: E731
    cache = cache.replace(k=jax.tree.map(fill, cache.k), v=jax.tree.map(fill, cache.v), lengths=jnp.array([1, 2, 3, 4]))
    rows = jnp.array([3, 1], jnp.int32)
    view = kv_cache.window(cache, w, rows)
    assert view.capacity == w and view.lengths.tolist() == [4, 2]
    batch = 0 if per_layer else 1  # stacked arrays are [L, B, ...]
    pick = lambda a: np.take(np.asarray(a), [3, 1], axis=batch)  # noqa: E731
    for full, cut in zip(jax.tree.leaves(cache.k), jax.tree.leaves(view.k)):
        np.testing.assert_array_equal(cut, pick(full)[..., :w])
    for full, cut in zip(jax.tree.leaves(cache.v), jax.tree.leaves(view.v)):
        np.testing.assert_array_equal(cut, pick(full)[..., :w, :])
    changed = view.replace(k=jax.tree.map(lambda a: a + 1, view.k), v=jax.tree.map(lambda a: a - 1, view.v),
                           lengths=view.lengths + 10)
    back = kv_cache.put_window(cache, changed, rows)
    assert back.capacity == 8 and back.lengths.tolist() == [1, 12, 3, 14]
    for old, new in zip(jax.tree.leaves(cache.k) + jax.tree.leaves(cache.v),
                        jax.tree.leaves(back.k) + jax.tree.leaves(back.v)):
        old, new = np.moveaxis(np.asarray(old), batch, 0), np.moveaxis(np.asarray(new), batch, 0)
        np.testing.assert_array_equal(new[[0, 2]], old[[0, 2]])  # the other rows
    for old, new in zip(jax.tree.leaves(cache.k), jax.tree.leaves(back.k)):
        np.testing.assert_array_equal(pick(new)[..., :w], pick(old)[..., :w] + 1)
        np.testing.assert_array_equal(pick(new)[..., w:], pick(old)[..., w:])
    for old, new in zip(jax.tree.leaves(cache.v), jax.tree.leaves(back.v)):
        np.testing.assert_array_equal(pick(new)[..., :w, :], pick(old)[..., :w, :] - 1)
        np.testing.assert_array_equal(pick(new)[..., w:, :], pick(old)[..., w:, :])


def test_cache_capacity_check():
    cache = kv_cache.init_cache(1, 2, 8, 1, 4)
    kv_cache.check_capacity(cache, 8)
    with pytest.raises(ValueError, match="KV cache overflow"):
        kv_cache.check_capacity(cache, 9)


@pytest.mark.parametrize("chunk_size", [1, 5, 12, 1000])
def test_chunked_logp_matches_naive(chunk_size):
    """Values and gradients equal the naive log_softmax + gather, for any chunk size."""
    kh, kw, kt, kg = jax.random.split(jax.random.key(3), 4)
    hidden = jax.random.normal(kh, (B, T, 16))
    w = jax.random.normal(kw, (50, 16))
    tokens = jax.random.randint(kt, (B, T), 0, 50)
    weights = jax.random.normal(kg, (2, B, T))

    def naive(hidden, w):
        logp_all = jax.nn.log_softmax(jnp.einsum("btd,vd->btv", hidden, w), axis=-1)
        lp = jnp.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)[:, :-1]
        zero = jnp.zeros((B, 1))
        return jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1)

    def chunked(hidden, w):
        return token_logprobs_and_entropy(hidden, w, tokens, chunk_size=chunk_size)

    def scalar(fn):
        return lambda h, w: jnp.sum(fn(h, w)[0] * weights[0]) + jnp.sum(fn(h, w)[1] * weights[1])

    got = jax.jit(chunked)(hidden, w)
    for a, b in zip(got, jax.jit(naive)(hidden, w)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert float(jnp.abs(got[0][:, 0]).max()) == 0.0
    g_chunk = jax.jit(jax.grad(scalar(chunked), argnums=(0, 1)))(hidden, w)
    g_naive = jax.jit(jax.grad(scalar(naive), argnums=(0, 1)))(hidden, w)
    for a, b in zip(g_chunk, g_naive):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_chunks_no_row_reads_are_skipped_and_nothing_read_changes():
    """With `mask` (the positions a loss reads), a chunk where no row reads a position is not
    computed (its logp / entropy are 0); every read position's value and every gradient equal
    the unmasked path's exactly, because the loss multiplies the others by 0."""
    B, T_, c = 3, 23, 5
    kh, kw, kt = jax.random.split(jax.random.key(11), 3)
    hidden = jax.random.normal(kh, (B, T_, 16))
    w = jax.random.normal(kw, (50, 16))
    tokens = jax.random.randint(kt, (B, T_), 0, 50)
    mask = np.zeros((B, T_), np.float32)
    mask[0, 12:14] = 1  # token 12 is predicted at position 11: chunk 2 of [0..4], [5..9], [10..14], ...
    mask[2, 21] = 1     # position 20: chunk 4 (the padded last one)
    mask = jnp.asarray(mask)

    def loss(h, w, m):
        lp, ent = token_logprobs_and_entropy(h, w, tokens, chunk_size=c, mask=m)
        return jnp.sum(lp * mask) + 0.1 * jnp.sum(ent * mask), (lp, ent)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (l_full, (lp_full, ent_full)), g_full = fn(hidden, w, None)
    (l_skip, (lp_skip, ent_skip)), g_skip = fn(hidden, w, mask)
    read = np.asarray(mask) > 0
    np.testing.assert_array_equal(np.asarray(lp_skip)[read], np.asarray(lp_full)[read])
    np.testing.assert_array_equal(np.asarray(ent_skip)[read], np.asarray(ent_full)[read])
    assert float(l_skip) == float(l_full)
    for a, b in zip(g_skip, g_full):
        np.testing.assert_array_equal(a, b)
    # the skipped chunks (0, 1, 3: positions 1..10 and 16..20 of logp) hold zeros
    skipped = np.zeros((B, T_), bool)
    skipped[:, 1:11] = skipped[:, 16:21] = True
    assert not np.asarray(lp_skip)[skipped].any() and not np.asarray(ent_skip)[skipped].any()
    assert np.asarray(lp_full)[skipped].all()  # ... which the full path does compute
    with pytest.raises(ValueError, match="mask"):
        token_logprobs_and_entropy(hidden, w, tokens, chunk_size=c, mask=mask[:, :-1])


def test_chunked_logp_keeps_batch_sharding():
    """Chunks run over T: a batch sharded over 8 devices stays sharded, with no collectives."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    hidden = jax.device_put(jax.random.normal(jax.random.key(7), (8, T, 16)), rows)
    tokens = jax.device_put(jax.random.randint(jax.random.key(8), (8, T), 0, 50), rows)
    w = jax.random.normal(jax.random.key(9), (50, 16))
    fn = jax.jit(lambda h, w, t: token_logprobs_and_entropy(h, w, t, chunk_size=5))
    logp, _ = fn(hidden, w, tokens)
    assert logp.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    hlo = fn.lower(hidden, w, tokens).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    np.testing.assert_allclose(logp, fn(np.asarray(hidden), w, np.asarray(tokens))[0], atol=1e-6)


def test_policy_outputs_alignment_and_sampler_agreement(model, fns):
    """logp/entropy/values are aligned with tokens; the sampler's per-step log-prob (decode
    logits through `logp_and_entropy_from_logits`) equals the trainer's chunked logp."""
    tokens, positions, mask = _batch(4)
    out = fns["outs"](fns["state"], tokens, positions, mask)
    hidden = model.hidden_states(tokens, positions, mask)
    values = model.values_from_hidden(hidden)
    np.testing.assert_allclose(out.values[:, 1:], values[:, :-1], atol=1e-6)
    assert float(jnp.abs(out.values[:, 0]).max()) == 0.0

    cache = model.init_cache(B, T)
    logits, cache = fns["prefill"](fns["state"], tokens[:, :1], cache, jnp.ones((B, 1), jnp.int32))
    ones = jnp.ones((B,), jnp.int32)
    for t in range(1, T):
        lp, ent = logp_and_entropy_from_logits(logits, tokens[:, t])
        np.testing.assert_allclose(lp, out.logp[:, t], atol=2e-5)
        np.testing.assert_allclose(ent, out.entropy[:, t], atol=2e-5)
        logits, cache = fns["decode"](fns["state"], tokens[:, t], cache, ones)


def test_value_head_absent_gives_none():
    cfg = dataclasses.replace(CFG, value_head=False, num_layers=1)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    assert nnx.jit(policy_outputs)(model, *_batch(b=1, t=4)).values is None
    with pytest.raises(ValueError, match="no value head"):
        model.values_from_hidden(jnp.zeros((1, 4, cfg.hidden_size)))


def test_remat_same_gradients(model):
    tokens, positions, mask = _batch(5, b=2, t=6)
    remat = nnx.merge(*nnx.split(model))
    remat.config = dataclasses.replace(CFG, remat=True)

    def loss(m):
        out = policy_outputs(m, tokens, positions, mask)
        return jnp.sum(out.logp) + jnp.sum(out.values)

    g1 = _params(nnx.jit(nnx.grad(loss))(model))
    g2 = _params(nnx.jit(nnx.grad(loss))(remat))
    for (name, a), (_, b) in zip(g1, g2):
        assert bool(jnp.any(a[...] != 0)), name  # every parameter receives gradient
        np.testing.assert_allclose(a[...], b[...], atol=1e-5, err_msg=str(name))


def test_remat_keeps_less_for_the_backward_pass():
    """remat on a model whose layers are unrolled (at most `unroll_layers`) keeps less scratch
    than the plain backward pass. A rematerialised block in an unrolled loop is one XLA may
    merge with the forward pass's copy or run ahead of the backward pass, which then keeps
    its activations all the same (and recomputes them too); decoder._layers scans under remat."""
    cfg = dataclasses.replace(CFG, num_layers=4, intermediate_size=128, value_head=False)
    assert cfg.num_layers <= cfg.unroll_layers
    tokens, positions, mask = _batch(7, b=4, t=256)

    def scratch(remat: bool) -> int:
        graphdef, state = nnx.split(CausalLM(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0)))
        grad = jax.jit(jax.grad(lambda s: jnp.sum(policy_outputs(nnx.merge(graphdef, s), tokens, positions, mask).logp)))
        memory = grad.lower(state).compile().memory_analysis()
        if memory is None:
            pytest.skip("this backend reports no memory analysis")
        return memory.temp_size_in_bytes

    plain, remat = scratch(False), scratch(True)
    assert remat < 0.6 * plain, (remat, plain)


def test_logical_axis_metadata(model):
    """Every parameter names one logical axis per dimension, from the shared vocabulary."""
    allowed = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers"}
    for name, var in _params(model):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var.ndim, name
        assert set(axes) <= allowed, name
        if var.ndim >= 2 and name[0] not in ("embed", "lm_head"):
            assert axes[0] == "layers", name


def test_bfloat16_forward_close_to_float32(fns):
    bf16_state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), fns["state"])
    batch = _batch(6)
    lo = fns["fwd"](bf16_state, *batch)
    hi = fns["fwd"](fns["state"], *batch)
    assert lo.dtype == jnp.float32
    assert float(jnp.abs(lo - hi).max()) < 0.15 * float(jnp.abs(hi).max())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        CausalLM(dataclasses.replace(CFG, num_kv_heads=3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="must be \\[B, T, D\\]"):
        token_logprobs_and_entropy(jnp.zeros((2, 3, 4)), jnp.zeros((5, 4)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="unsupported rope_type"):
        CausalLM(dataclasses.replace(CFG, rope_type="yarn"), rngs=nnx.Rngs(0))(*_batch(b=1, t=2))
