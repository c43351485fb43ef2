"""Tests for sampling/ (decode.py, engine.py): logp parity with the trainer, greedy == argmax,
seeding, row independence, multi-turn == re-prefill, refill, no recompilation, clear errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agent.config import SamplingConfig
from jaxrl_agent.model.decoder import CausalLM, ModelConfig
from jaxrl_agent.model.outputs import policy_outputs
from jaxrl_agent.sampling.decode import process_logits, select_tokens
from jaxrl_agent.sampling.engine import SamplingEngine

CFG = ModelConfig(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, rope_theta=1000.0, qkv_bias=True, qk_norm=True,
)
S = 64  # cache slots per row
# decode_window 16: every test's episodes cross the windows 16, 32, 48, 64 of the decode loop.
SAMPLE = SamplingConfig(
    temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=8, batch_size=4, cache_size=S,
    prefill_buckets=(8, 16, 32), seed=7, decode_window=16,
)
GREEDY = dataclasses.replace(SAMPLE, temperature=0.0, top_k=0, top_p=1.0)


def _perturbed(seed=0):
    """A model whose norms/biases are off their trivial init and whose logits are peaked
    enough that sampling is far from uniform."""
    model = CausalLM(CFG, rngs=nnx.Rngs(seed), init_std=0.2)
    key = jax.random.key(seed + 100)
    for i, ((name,), var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        noise = 0.1 * jax.random.normal(jax.random.fold_in(key, i), var.shape)
        getattr(model, name).set_value(var[...] + noise)
    return model


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).tolist()


@pytest.fixture(scope="module")
def model():
    return _perturbed()


@pytest.fixture(scope="module")
def eng(model):
    return SamplingEngine(model, SAMPLE)


@pytest.fixture(scope="module")
def greedy_eng(model):
    return SamplingEngine(model, GREEDY)


@pytest.fixture(scope="module")
def full_forward(model):
    """Jitted trainer-side pass over sequences padded to S: (logits [B, S, V], logp [B, S])."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, mask):
        m = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), tokens.shape)
        return m(tokens, pos, mask), policy_outputs(m, tokens, pos, mask, chunk_size=16).logp

    def run(seqs):
        tokens = np.zeros((len(seqs), S), np.int32)
        mask = np.zeros((len(seqs), S), np.int32)
        for b, s in enumerate(seqs):
            tokens[b, : len(s)], mask[b, : len(s)] = s, 1
        logits, logp = fwd(state, tokens, mask)
        return np.asarray(logits), np.asarray(logp)

    return run


def _rollout(eng, prompts, seeds, obs, turns=3):
    """Start episodes in rows 0..len(prompts)-1, then `turns` turns with observations appended.

    Returns per row: list of (start index in the sequence, ids, logp, sample_logp) per turn.
    """
    for b, (p, s) in enumerate(zip(prompts, seeds)):
        eng.start_episode(b, p, seed=s)
    for b in range(len(prompts), eng.config.batch_size):
        eng.end_episode(b)
    record = [[] for _ in prompts]
    for turn in range(turns):
        starts = [len(eng.tokens(b)) for b in range(len(prompts))]
        res = eng.sample_turn()
        for b in range(len(prompts)):
            ids, lp, slp = res.row(b)
            record[b].append((starts[b], ids, lp, slp))
            if turn < turns - 1:
                eng.append(b, obs[b][turn])
    return record


# ---- parity with the trainer ----


def test_sampler_logp_equals_trainer_logp(eng, full_forward):
    prompts = [_prompt(1, 5), _prompt(2, 11), _prompt(3, 3), _prompt(4, 17)]
    obs = [[_prompt(10 + b, 2 + 3 * b), _prompt(20 + b, 4)] for b in range(4)]
    record = _rollout(eng, prompts, [1, 2, 3, 4], obs)
    seqs = [eng.tokens(b) for b in range(4)]
    logits, logp = full_forward(seqs)
    worst, n_checked = 0.0, 0
    for b in range(4):
        for start, ids, lp, slp in record[b]:
            assert seqs[b][start : start + len(ids)] == ids  # the sequence holds exactly what was sampled
            for i, tok in enumerate(ids):
                t = start + i
                worst = max(worst, abs(lp[i] - logp[b, t]))
                # sampling log-prob == the processed distribution of the full-forward logits
                x = np.asarray(process_logits(jnp.asarray(logits[b, t - 1][None]), SAMPLE))[0]
                ref = x[tok] - np.log(np.sum(np.exp(x - x.max()))) - x.max()
                assert abs(slp[i] - ref) < 1e-4 and slp[i] >= lp[i] - 1e-4  # truncation only adds mass
                n_checked += 1
    assert n_checked >= 40 and worst <= 1e-5, (n_checked, worst)


def test_greedy_equals_argmax_of_full_forward(greedy_eng, full_forward):
    prompts = [_prompt(5, 9), _prompt(6, 4), _prompt(7, 14)]
    obs = [[_prompt(30 + b, 3), _prompt(40 + b, 5)] for b in range(3)]
    record = _rollout(greedy_eng, prompts, [0, 0, 0], obs)
    seqs = [greedy_eng.tokens(b) for b in range(3)]
    logits, logp = full_forward(seqs)
    for b in range(3):
        for start, ids, lp, slp in record[b]:
            assert len(ids) == GREEDY.max_new_tokens
            assert ids == np.argmax(logits[b, start - 1 : start - 1 + len(ids)], axis=-1).tolist()
            np.testing.assert_allclose(lp, logp[b, start : start + len(ids)], atol=1e-5)
            assert slp == [0.0] * len(ids)


# ---- seeding and independence ----


def test_same_seed_same_tokens_and_different_seed_differs(eng):
    prompts, obs = [_prompt(8, 6), _prompt(9, 10)], [[_prompt(50, 3), _prompt(51, 3)]] * 2
    a = _rollout(eng, prompts, [11, 12], obs)
    b = _rollout(eng, prompts, [11, 12], obs)
    c = _rollout(eng, prompts, [13, 14], obs)
    assert a == b
    assert [t[1] for t in a[0]] != [t[1] for t in c[0]]


def test_row_independence(model, eng):
    """An episode's tokens depend on its seed and ids only: not on its row, its neighbours
    (other prompts at other lengths, or none) or the batch size."""
    ep, ep_obs = _prompt(60, 7), [_prompt(61, 5), _prompt(62, 2)]
    ref = _rollout(eng, [ep], [99], [ep_obs])[0]  # alone (other rows free)
    others = [_prompt(63, 13), _prompt(64, 2), _prompt(65, 20)]
    batch = _rollout(eng, others[:2] + [ep] + others[2:], [1, 2, 99, 3], [[_prompt(66, 9)] * 2] * 2 + [ep_obs] + [[_prompt(67, 1)] * 2])[2]
    single = SamplingEngine(model, dataclasses.replace(SAMPLE, batch_size=1))
    one = _rollout(single, [ep], [99], [ep_obs])[0]
    for got in (batch, one):
        for (s0, ids0, lp0, slp0), (s1, ids1, lp1, slp1) in zip(ref, got):
            assert (s0, ids0) == (s1, ids1)
            np.testing.assert_allclose(lp0, lp1, atol=1e-5)
            np.testing.assert_allclose(slp0, slp1, atol=1e-5)


def test_stored_programs_sample_what_the_jit_samples(model, eng, tmp_path, monkeypatch):
    """With the program store on (program_store.py; the CLI's persistent cache), an engine
    samples exactly what the plain jit's engine samples, and a second engine (a warm start)
    loads the prefill and decode programs from disk without tracing them."""
    from jaxrl_agent import program_store
    from jaxrl_agent.sampling import decode

    prompts, obs = [_prompt(110, 6), _prompt(111, 19)], [[_prompt(112, 3), _prompt(113, 5)]] * 2
    want = _rollout(eng, prompts, [3, 4], obs)
    monkeypatch.setattr(program_store, "DIRECTORY", str(tmp_path))
    traced = []
    for name in ("prefill_rows", "generate"):
        real = getattr(decode, name)
        monkeypatch.setattr(decode, name, lambda *a, _f=real, _n=name, **k: traced.append(_n) or _f(*a, **k))
    cold = _rollout(SamplingEngine(model, SAMPLE), prompts, [3, 4], obs)
    assert "generate" in traced and "prefill_rows" in traced
    traced.clear()
    warm = _rollout(SamplingEngine(model, SAMPLE), prompts, [3, 4], obs)
    assert traced == []
    assert cold == want and warm == want


def test_decode_windows_change_no_token(model, eng):
    """Windowed decoding (W = 16: four loops over S = 64) samples the same tokens, with the
    same log-probs up to rounding, as attending to all S slots in one loop."""
    from jaxrl_agent.sampling.decode import decode_windows

    assert decode_windows(64, 16) == (16, 32, 48, 64) and decode_windows(64, 0) == (64,)
    assert decode_windows(64, 64) == (64,) and decode_windows(70, 32) == (32, 64, 70)
    prompts = [_prompt(70, 3), _prompt(71, 15), _prompt(72, 30), _prompt(73, 9)]
    obs = [[_prompt(80 + b, 7), _prompt(90 + b, 4)] for b in range(4)]
    windowed = _rollout(eng, prompts, [5, 6, 7, 8], obs)
    full = _rollout(SamplingEngine(model, dataclasses.replace(SAMPLE, decode_window=0)), prompts, [5, 6, 7, 8], obs)
    assert max(len(eng.tokens(b)) for b in range(4)) > 48  # the last window was reached
    for row_w, row_f in zip(windowed, full):
        for (s0, ids0, lp0, slp0), (s1, ids1, lp1, slp1) in zip(row_w, row_f):
            assert (s0, ids0) == (s1, ids1)
            np.testing.assert_allclose(lp0, lp1, atol=1e-5)
            np.testing.assert_allclose(slp0, slp1, atol=1e-5)


def test_skipping_windows_no_row_fits_changes_nothing(model):
    """The decode loop skips a window no live row fits in (late in an episode); the sampled
    tokens, log-probs, cache and logits equal the former loop's, which copied each such window
    in and out and ran no step in it. Rows past W (that window skipped from the start), and
    short rows that outgrow W mid-turn (a window runs, the next takes over, the rest skip)."""
    from functools import partial

    from jaxrl_agent.sampling.decode import generate

    graphdef, state = nnx.split(model)
    loops = {skip: jax.jit(partial(generate, config=SAMPLE, skip_empty_windows=skip)) for skip in (True, False)}
    for lengths in ((20, 30, 3, 25), (3, 5, 8, 2)):
        engine = SamplingEngine(model, SAMPLE)
        for b, n in enumerate(lengths):
            engine.start_episode(b, _prompt(400 + b, n), seed=b)
        engine.flush()
        outs = {}
        for skip, fn in loops.items():
            outs[skip] = jax.device_get(fn(nnx.merge(graphdef, state), jax.tree.map(jnp.copy, engine.cache),
                                           jnp.copy(engine.logits), engine._base_seed, engine._seeds.copy(),
                                           np.ones(4, bool), np.full(4, 10, np.int32), engine._stop.copy()))
        assert outs[True][0].num_new.max() > 0
        for x, y in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_turns_split_over_advance_calls_change_no_token(eng):
    """A turn decoded 3 steps per `advance` call, rows ending their turns at different calls
    (and one at the end of its cache), holds exactly the ids, log-probs and finish reasons of
    the same turn in one `sample_turn`; rows mid-turn report nothing and refuse `append`."""
    prompts = [_prompt(60, 5), _prompt(61, 30), _prompt(62, 9)]

    def start():
        for b, p in enumerate(prompts):
            eng.start_episode(b, p, seed=b)
        eng.end_episode(3)
        eng.append(1, _prompt(63, 30))  # 60 of S=64 slots: row 1 fills its cache after 4 tokens

    start()
    whole = eng.sample_turn([0, 1, 2], max_new_tokens=7)
    whole_tokens = [eng.tokens(b) for b in range(3)]
    start()
    eng.begin_turn([0, 1], max_new_tokens=7)
    ended = {}
    for call in range(6):
        if call == 1:
            eng.begin_turn([2], max_new_tokens=7)  # a row may join while others are mid-turn
        res = eng.advance(3)
        for b, reason in enumerate(res.finish_reason):
            if reason is not None:
                assert b not in ended
                ended[b] = (reason, *res.row(b))
            elif b in eng.in_turn():
                assert res.num_new[b] == 0
                with pytest.raises(ValueError, match="in a turn"):
                    eng.append(b, [1])
                with pytest.raises(ValueError, match="already in a turn"):
                    eng.begin_turn([b])
    assert eng.in_turn() == [] and sorted(ended) == [0, 1, 2]
    assert ended[1][0] == "cache_full" == whole.finish_reason[1]
    for b in range(3):
        reason, ids, lp, slp = ended[b]
        assert reason == whole.finish_reason[b] and ids == whole.row(b)[0]
        np.testing.assert_allclose(lp, whole.row(b)[1], atol=1e-5)
        np.testing.assert_allclose(slp, whole.row(b)[2], atol=1e-5)
        assert eng.tokens(b) == whole_tokens[b]


@pytest.mark.parametrize("layers", ["unrolled", "scanned"])
def test_decoding_only_the_rows_in_a_turn_changes_no_token(model, layers):
    """Decode calls on the rows in a turn, gathered into a decode row bucket (here 2 of B=4,
    padded with a row that holds an episode between turns), give the ids, log-probs, finish
    reasons and caches of decoding all 4 rows every call, for fewer row-steps; with per-layer
    cache arrays and with the stacked ones of a scanned model."""
    if layers == "scanned":
        model = CausalLM(dataclasses.replace(CFG, unroll_layers=0), rngs=nnx.Rngs(5), init_std=0.2)
    engines = {name: SamplingEngine(model, dataclasses.replace(SAMPLE, decode_row_buckets=buckets))
               for name, buckets in (("rows", (2,)), ("all", (4,)))}
    assert engines["rows"].decode_row_buckets == (2, 4) and engines["all"].decode_row_buckets == (4,)
    prompts = [_prompt(70, 6), _prompt(71, 11), _prompt(72, 3)]
    got = {}
    for name, e in engines.items():
        for b, p in enumerate(prompts):
            e.start_episode(b, p, seed=20 + b)
        e.end_episode(3)
        e.begin_turn([0], max_new_tokens=3)
        e.begin_turn([1], max_new_tokens=8)
        turns = []
        while e.in_turn():  # 2 rows, then row 1 alone (with row 0 as the padding row)
            turns.append(e.advance(2))
        turns.append(e.sample_turn())  # 3 rows: all 4 decode
        for b in range(3):
            e.append(b, _prompt(90 + b, 4))
        e.begin_turn([2], max_new_tokens=5)  # row 2 alone, padded with a row between turns
        turns.append(e.advance(8))
        got[name] = ([(t.finish_reason, [t.row(b) for b in range(4)]) for t in turns],
                     [e.tokens(b) for b in range(4)], e.decode_row_steps)
    (turns_r, tokens_r, steps_r), (turns_a, tokens_a, steps_a) = got["rows"], got["all"]
    assert tokens_r == tokens_a and len(turns_r) == len(turns_a)
    for (reasons_r, rows_r), (reasons_a, rows_a) in zip(turns_r, turns_a):
        assert reasons_r == reasons_a
        for (ids_r, lp_r, slp_r), (ids_a, lp_a, slp_a) in zip(rows_r, rows_a):
            assert ids_r == ids_a
            np.testing.assert_allclose(lp_r, lp_a, atol=1e-5)
            np.testing.assert_allclose(slp_r, slp_a, atol=1e-5)
    assert steps_r < steps_a


def test_shared_prompt_prefixes_change_no_token(model):
    """A prompt whose prefix some row's cache holds (another live row, a freed row, the row's
    own previous episode, a source row restarted before the copy ran) copies that prefix
    instead of prefilling it, and samples what a whole prefill samples."""
    share = SamplingEngine(model, dataclasses.replace(SAMPLE, share_prefix_min=8))
    ref = SamplingEngine(model, dataclasses.replace(SAMPLE, share_prefix_min=0))
    p = _prompt(40, 26)
    q = p[:20] + _prompt(41, 6)  # shares its first 20 tokens with p

    def run(e, plan):
        out = {}
        for step in plan:
            for row, prompt, seed in step.get("start", []):
                e.start_episode(row, prompt, seed=seed)
            for row in step.get("end", []):
                e.end_episode(row)
            res = e.sample_turn(step["sample"])
            out.update({(len(out), r): res.row(r) for r in step["sample"]})
        return out

    plan = [
        {"start": [(0, p, 1), (1, _prompt(42, 12), 2), (2, _prompt(43, 9), 3)], "end": [3], "sample": [0, 1, 2]},
        {"start": [(3, p, 4)], "sample": [3]},  # p from live row 0 (25 tokens)
        {"start": [(2, q, 5)], "sample": [2]},  # q's first 20 tokens from row 0 or 3
        {"end": [0], "start": [(1, p, 6)], "sample": [1]},  # from rows 0 (freed) or 3
        {"start": [(0, p, 7)], "sample": [0]},  # the row's own previous episode
        {"start": [(2, p, 8), (0, _prompt(44, 5), 9)], "sample": [0, 2]},  # source row 0 (the first of 0, 1, 3) restarted first
        # a group starting together: rows 1-3 copy row 0's prompt once this flush prefilled it
        {"start": [(b, r, 10 + b) for b, r in enumerate([q[:-1] + [5, 6, 7, 8], q, q, q])], "sample": [0, 1, 2, 3]},
        # a staged leader restarted, or freed, before the flush: its followers are served first
        {"start": [(0, p[:-2] + [9, 9], 20), (1, p[:-1] + [4], 21), (0, _prompt(45, 7), 22)], "sample": [0, 1]},
        {"start": [(2, p[:-1] + [3], 23), (3, p[:-1] + [3, 7], 24)], "end": [2], "sample": [3]},
    ]
    got, want = run(share, plan), run(ref, plan)
    # per step: 0, 25, 20, 25, 25, 25; 20 + 25 + 2 x 26 (row 0 copied 20 from the cache, row 1
    # follows row 0's staged prompt, rows 2-3 take row 1's whole prompt q and its logits);
    # 20 + 24 (row 1 follows row 0); 25 + 26 (row 3 follows row 2)
    assert share.tokens_shared == 4 * 25 + 20 + 20 + 25 + 2 * 26 + 20 + 24 + 25 + 26 and ref.tokens_shared == 0
    # every token entered the cache once, by a prefill or a copy; only the two staged leaders
    # that were replaced or freed before a flush (26 tokens each) entered share's cache and
    # not ref's: they were prefilled first to serve their followers
    assert share.tokens_prefilled + share.tokens_shared == ref.tokens_prefilled + 2 * 26
    assert got.keys() == want.keys()
    for k in want:
        assert got[k][0] == want[k][0]
        np.testing.assert_allclose(got[k][1], want[k][1], atol=1e-5)
    for b in range(4):
        assert share.tokens(b) == ref.tokens(b)


def test_a_group_follows_its_own_first_row_not_the_shorter_shared_prefix(model):
    """Groups starting together (GRPO: several prompts x G rows): the next group's first row
    shares only a common head (the system prompt) with the group before it; the rest of its
    group copy its whole prompt and its next-token logits from it (a follower of a follower,
    served in a later round of the flush) instead of the common head, prefill nothing, and
    sample what whole prefills sample."""
    share = SamplingEngine(model, dataclasses.replace(SAMPLE, share_prefix_min=8))
    ref = SamplingEngine(model, dataclasses.replace(SAMPLE, share_prefix_min=0))
    a = _prompt(60, 30)
    b = a[:12] + _prompt(61, 18)  # a 12-token common head, then its own task
    outs = []
    for e in (share, ref):
        for row, prompt in enumerate([a, a, b, b]):
            e.start_episode(row, prompt, seed=row)
        outs.append(e.sample_turn([0, 1, 2, 3]))
    # row 1 copies all of a and row 0's next-token logits; row 2 the 12-token head, then
    # prefills its 18; row 3 all of b and its logits from row 2, once row 2 has them
    assert share.tokens_shared == 30 + 12 + 30
    assert share.tokens_prefilled == 30 + 18 and ref.tokens_prefilled == 4 * 30
    for r in range(4):
        assert outs[0].row(r)[0] == outs[1].row(r)[0]
        np.testing.assert_allclose(outs[0].row(r)[1], outs[1].row(r)[1], atol=1e-5)
    # a source appended to before the flush has other next-token logits: its follower prefills its own
    outs = []
    for e in (share, ref):
        e.start_episode(0, b, seed=7)
        e.start_episode(1, b, seed=8)
        e.append(0, [3, 4])
        outs.append(e.sample_turn([0, 1]))
    for r in range(2):
        assert outs[0].row(r)[0] == outs[1].row(r)[0]
        np.testing.assert_allclose(outs[0].row(r)[1], outs[1].row(r)[1], atol=1e-5)


def test_new_params_are_never_served_old_prefixes(model):
    """After `update_params` no prompt copies keys and values computed with the old params,
    not even a copy that was pending when the params changed: it samples what a fresh engine
    on the new params samples."""
    other = _perturbed(seed=3)
    share = SamplingEngine(model, dataclasses.replace(SAMPLE, share_prefix_min=8))
    p = _prompt(50, 26)
    share.start_episode(0, p, seed=1)
    share.sample_turn([0])
    share.start_episode(1, p, seed=2)  # would copy row 0's 25 tokens at the next flush
    assert share.tokens_shared == 0
    share.update_params(nnx.state(other))
    share.start_episode(2, p, seed=3)  # row 0's cache is from the old params
    got = share.sample_turn([1, 2])
    fresh = SamplingEngine(other, dataclasses.replace(SAMPLE, share_prefix_min=0))
    fresh.start_episode(1, p, seed=2)
    fresh.start_episode(2, p, seed=3)
    want = fresh.sample_turn([1, 2])
    assert share.tokens_shared == 26  # row 2 took row 1's whole prompt and logits, prefilled in the same flush
    for b in (1, 2):
        assert got.row(b)[0] == want.row(b)[0]
        np.testing.assert_allclose(got.row(b)[1], want.row(b)[1], atol=1e-5)


def test_multi_turn_equals_reprefilled_conversation(eng):
    """Turn 2 after an appended observation == turn 2 from a fresh prefill of the whole
    conversation (same episode seed), so appending never needs to re-run the past."""
    prompt, obs = _prompt(70, 9), _prompt(71, 6)
    eng.start_episode(0, prompt, seed=5)
    for b in range(1, 4):
        eng.end_episode(b)
    eng.sample_turn()
    eng.append(0, obs)
    conversation = eng.tokens(0)
    ids, lp, _ = eng.sample_turn().row(0)
    eng.start_episode(3, conversation, seed=5)  # refill another row with the whole conversation
    eng.end_episode(0)
    ids2, lp2, _ = eng.sample_turn().row(3)
    assert ids == ids2 and len(ids) > 0
    np.testing.assert_allclose(lp, lp2, atol=1e-5)
    assert eng.tokens(3) == conversation + ids


def test_flush_prefills_only_staged_rows_per_bucket(eng, full_forward):
    """A flush whose rows need different buckets (or nothing) runs the planned prefills on
    just those rows (`prefill_plan`); every row's logits still predict the token after its
    whole sequence, and a row with nothing staged keeps its logits."""
    prompts = [_prompt(70 + b, n) for b, n in enumerate((5, 12, 3, 6))]
    for b in range(4):
        eng.start_episode(b, prompts[b], seed=b)
    slots = eng.prefill_slots
    eng.flush()  # buckets 8 and 16: cheapest as one call of 4 rows x 16 (two calls cost more)
    assert eng.prefill_slots - slots == 4 * 16
    before = np.asarray(eng.logits).copy()
    extra = {0: _prompt(80, 20), 2: _prompt(81, 4)}  # buckets 32 and 8; rows 1 and 3 stay put
    padded = eng.tokens_prefill_padded
    for b, ids in extra.items():
        eng.append(b, ids)
    eng.flush()
    assert eng.tokens_prefill_padded - padded == 32 + 8  # per bucket, not B x the longest
    assert eng.prefill_slots - slots - 4 * 16 == 32 + 8  # two one-row calls, no padding rows
    seqs = [eng.tokens(b) for b in range(4)]
    assert seqs[0] == prompts[0] + extra[0] and seqs[1] == prompts[1]
    ref, _ = full_forward(seqs)
    got = np.asarray(eng.logits)
    for b in range(4):
        np.testing.assert_allclose(got[b], ref[b, len(seqs[b]) - 1], atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(got[[1, 3]], before[[1, 3]])


def test_refill_resets_the_row(eng):
    """A row refilled after a long episode behaves exactly like a fresh row (no stale cache)."""
    ep = _prompt(80, 5)
    fresh = _rollout(eng, [ep], [42], [[[1, 2], [3]]], turns=2)[0]
    long = _prompt(81, 30)
    eng.start_episode(0, long, seed=1)
    eng.sample_turn()
    eng.append(0, _prompt(82, 20))
    eng.sample_turn()
    eng.start_episode(0, ep, seed=42)
    ids, lp, _ = eng.sample_turn().row(0)
    assert ids == fresh[0][1] and eng.tokens(0) == ep + ids
    np.testing.assert_allclose(lp, fresh[0][2], atol=1e-5)


# ---- stops, budgets, capacity ----


def test_per_row_stop_sets_and_budgets(greedy_eng):
    eng = greedy_eng
    p0, p1 = _prompt(90, 6), _prompt(91, 8)
    eng.start_episode(0, p0, seed=0)
    eng.start_episode(1, p1, seed=0)
    for b in (2, 3):
        eng.end_episode(b)
    free = eng.sample_turn()
    g0, g1 = free.row(0)[0], free.row(1)[0]
    # Row 0 stops at the 3rd greedy token, row 1 at its 5th (first occurrence), with different sets.
    k0, k1 = g0.index(g0[2]), g1.index(g1[4])
    eng.start_episode(0, p0, seed=0, stop_ids=[g0[2]])
    eng.start_episode(1, p1, seed=0, stop_ids=[g1[4], g1[4]])
    res = eng.sample_turn()
    assert res.row(0)[0] == g0[: k0 + 1] and res.row(1)[0] == g1[: k1 + 1]
    assert res.finish_reason[:2] == ("stop", "stop") and res.finish_reason[2:] == (None, None)
    assert res.stopped[:2].all() and res.num_new[2:].tolist() == [0, 0]
    assert eng.tokens(0) == p0 + g0[: k0 + 1]  # the stop token is kept in the episode and cache
    # per-call budget
    eng.start_episode(0, p0, seed=0)
    res = eng.sample_turn(max_new_tokens=3)
    assert res.row(0)[0] == g0[:3] and res.finish_reason[0] == "length"
    # the end of the cache
    eng.start_episode(2, _prompt(92, 30), seed=0)
    eng.append(2, _prompt(93, 30))  # 60 of S=64 slots
    res = eng.sample_turn([2])
    assert res.num_new[2] == 4 and res.finish_reason[2] == "cache_full" and len(eng.tokens(2)) == S
    res = eng.sample_turn([2])
    assert res.num_new[2] == 0 and res.finish_reason[2] == "cache_full"


# ---- compilation ----


def test_no_compilation_after_warmup(model, eng):
    """Warm-up compiles every bucket; a multi-turn rollout with refills, across buckets and
    with new params, then compiles nothing (counted from JAX's own compile events)."""
    perturbed = nnx.state(_perturbed(seed=3))
    eng.warmup()
    before = eng.num_compiled()
    assert eng.row_buckets == (1, 4)  # 1, ceil(B/4), B for B = 4
    # + a decode loop per decode row bucket, + the prefix copy (compiled once per cache
    # placement the module's earlier tests gave it)
    assert eng.decode_row_buckets == (1, 2, 4)  # ceil(B/4), ceil(B/2), B
    assert before == (len(eng.row_buckets) * len(SAMPLE.prefill_buckets) + len(eng.decode_row_buckets)
                      + eng._copy_fn._cache_size())
    assert eng._copy_fn._cache_size() >= 1
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(0)
        for it in range(2):
            for b in range(4):
                eng.start_episode(b, _prompt(100 + b + 10 * it, int(rng.integers(1, 30))), seed=b)
            for turn in range(4):
                res = eng.sample_turn()
                for b in range(4):
                    if turn == 1 and b == it:  # continuous batching: refill a row mid-rollout
                        eng.start_episode(b, _prompt(200 + b, int(rng.integers(1, 9))), seed=50 + b)
                    elif len(eng.tokens(b)) + 12 < S - 8:
                        eng.append(b, _prompt(300 + turn, int(rng.integers(1, 12))))
                assert all(r is not None for r in res.finish_reason)
            eng.update_params(perturbed)  # the RL loop's new params: same shapes, no retrace
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [] and eng.num_compiled() == before
    eng.update_params(model)


# ---- token selection ----


def _np_reference_keep(logits, temperature, top_k, top_p):
    """NumPy reference of the kept token set: temperature, top-k, then top-p."""
    x = logits / temperature
    keep = np.ones_like(x, bool)
    if top_k:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        order = np.argsort(-x, kind="stable")
        xs = np.where(keep, x, -np.inf)[order]
        p = np.exp(xs - xs.max())
        p /= p.sum()
        before = np.cumsum(p) - p
        kept = order[: max(1, int(np.sum(before < top_p)))]
        keep &= x >= x[kept].min()
    return keep


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 12, 0.8), (1.0, 1, 1.0)])
def test_process_and_select_tokens(temperature, top_k, top_p):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = 3.0 * jax.random.normal(jax.random.key(0), (6, CFG.vocab_size))
    x = np.asarray(process_logits(logits, cfg))
    keys = jax.random.split(jax.random.key(1), 6)
    tok, lp, slp = (np.asarray(a) for a in select_tokens(logits, keys, cfg))
    ref_lp = np.asarray(jax.nn.log_softmax(logits))
    for b in range(6):
        keep = _np_reference_keep(np.asarray(logits[b]), temperature, top_k, top_p)
        np.testing.assert_array_equal(x[b] > -1e29, keep)
        assert keep[tok[b]]
        np.testing.assert_allclose(lp[b], ref_lp[b, tok[b]], atol=1e-6)
        kept = x[b][keep]
        np.testing.assert_allclose(slp[b], x[b, tok[b]] - np.log(np.sum(np.exp(kept - kept.max()))) - kept.max(), atol=1e-5)
    if top_k == 1:
        np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), axis=-1))
    if (temperature, top_k, top_p) == (1.0, 0, 1.0):
        np.testing.assert_allclose(slp, lp, atol=1e-6)  # no processing: both distributions agree


# ---- errors ----


def test_bad_inputs_raise_clear_errors(model, eng):
    eng.start_episode(0, [1, 2, 3], seed=0)
    before = eng.tokens(0)
    cases = [
        (lambda: eng.start_episode(1, _prompt(0, S + 1)), "does not fit row 1's KV cache"),
        (lambda: eng.start_episode(1, _prompt(0, 33)), "does not fit a prefill bucket"),
        (lambda: eng.start_episode(1, []), "empty"),
        (lambda: eng.start_episode(1, [1, CFG.vocab_size]), "outside"),
        (lambda: eng.start_episode(1, [[1, 2]]), "1-D"),
        (lambda: eng.start_episode(4, [1]), "out of range"),
        (lambda: eng.start_episode(1, [1], stop_ids=[1, 2, 3, 4, 5]), "max_stop_tokens"),
        (lambda: eng.append(0, _prompt(0, 40)), "prefill bucket"),
        (lambda: eng.append(3, [1]), "holds no episode"),
        (lambda: eng.sample_turn(max_new_tokens=9), "max_new_tokens"),
        (lambda: eng.sample_turn([3]), "holds no episode"),
        (lambda: eng.update_params({"x": jnp.zeros(3)}), "structure"),
        (lambda: SamplingEngine(model, dataclasses.replace(SAMPLE, top_p=0.0)), "top_p"),
        (lambda: SamplingEngine(model, dataclasses.replace(SAMPLE, temperature=-1.0)), "temperature"),
        (lambda: SamplingEngine(model, dataclasses.replace(SAMPLE, stop_token_ids=(500,))), "stop_token_ids"),
        (lambda: SamplingEngine(model, dataclasses.replace(SAMPLE, prefill_row_buckets=(2, 5))), "prefill_row_buckets"),
    ]
    eng.end_episode(3)
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    assert eng.tokens(0) == before  # a rejected call changes nothing
    eng.append(0, [4])
    assert eng.sample_turn([0]).num_new[0] > 0
