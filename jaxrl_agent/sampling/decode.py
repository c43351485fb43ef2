"""DEVICE: jitted prefill and decode loop over a fixed-size KV cache (DESIGN §6).

Pure functions of the model, the cache and small per-row tables; `engine.py` is the
host-side driver (multi-turn episodes, continuous batching, shape buckets).

Engine state on device is a pair `(cache, logits)`:

    cache   KVCache (model/kv_cache.py), lengths [B]           every token of row b's episode so far
    logits  [B, V] float32                               next-token logits of each row

Invariant: every token of an episode enters the cache exactly once, either by `prefill` (text
the harness rendered: prompt, tool results), by the decode loop (tokens the policy sampled,
the final stop token included) or by `copy_rows` (a prompt prefix another row already holds:
a slot's keys and values depend only on the tokens up to it), and `logits[b]` always predicts
the token after the last one in row b. So a tool result is appended by prefilling just its
tokens, and the next turn starts sampling from the logits that prefill returned; the
conversation is never re-run.

Randomness is keyed per row and per position: the token written to slot p of row b is drawn
with `fold_in(fold_in(key(base_seed), episode_seed[b]), p)`. A row's tokens therefore do not
depend on its batch index, on the other rows, or on how its episode was split into turns.

Log-probs: `logp` is the policy's log-prob of the sampled token (temperature 1, no truncation),
computed by `logprobs.logp_and_entropy_from_logits`, the function the trainer uses, so it equals
the trainer's `logp` on the final sequence. `sample_logp` is the log-prob under the
distribution actually sampled from (temperature, top-k, top-p; 0 for greedy).

Dims: B rows, T chunk length, N max new tokens per turn, M stop ids per row, V vocab.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxrl_agent.config import SamplingConfig
from jaxrl_agent.model import kv_cache
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.model.kv_cache import KVCache
from jaxrl_agent.model.logprobs import logp_and_entropy_from_logits
from jaxrl_agent.program_store import StoredJit

_FILTERED = -1e30  # logit of a token removed by top-k / top-p (finite: no inf - inf NaNs)
PAD_ID = -1  # token id written to output slots past a row's last sampled token


@struct.dataclass
class TurnOutput:
    """What one decode loop produced; slots past `num_new[b]` hold PAD_ID / 0."""

    tokens: jax.Array
    """int32 `[B, N]` sampled ids."""
    logp: jax.Array
    """float32 `[B, N]` policy log-prob (temperature 1, no truncation) of each sampled id."""
    sample_logp: jax.Array
    """float32 `[B, N]` log-prob under the processed distribution actually sampled from."""
    num_new: jax.Array
    """int32 `[B]` tokens sampled per row this turn."""
    stopped: jax.Array
    """bool `[B]` the row sampled one of its stop tokens (its turn is complete)."""


# ---- token selection ----


def row_keys(base_seed: jax.Array, episode_seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-row PRNG keys `[B]` for sampling the token that goes to slot `positions[b]`.

    Args: base_seed uint32 scalar; episode_seeds uint32 `[B]`; positions int32 `[B]`.
    The key depends only on (base_seed, episode_seeds[b], positions[b]), never on b.
    """
    base = jax.random.key(base_seed)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(episode_seeds, positions)


def process_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """Logits of the sampling distribution: temperature, then top-k, then top-p (HF order).

    Args: logits float32 `[B, V]`; config with temperature > 0 (static).
    Returns: float32 `[B, V]`, removed tokens set to a large negative finite value. Tokens
    tied with the last kept logit are kept too. top-p keeps the smallest prefix of the sorted
    distribution (renormalised after top-k) whose mass reaches top_p; the top token is always kept.
    """
    x = logits.astype(jnp.float32) / config.temperature
    v = x.shape[-1]
    if 0 < config.top_k < v:
        # top_k values come back sorted (descending); top-p then only needs these k.
        desc = jax.lax.top_k(x, config.top_k)[0]  # [B, k]
        x = jnp.where(x >= desc[:, -1:], x, _FILTERED)
    elif config.top_p < 1.0:
        desc = -jnp.sort(-x, axis=-1)  # [B, V]
    if config.top_p < 1.0:
        p = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(p, axis=-1) - p  # probability of the strictly more likely tokens
        n_keep = jnp.maximum(jnp.sum(mass_before < config.top_p, axis=-1, keepdims=True), 1)  # [B, 1]
        threshold = jnp.take_along_axis(desc, n_keep - 1, axis=-1)  # [B, 1]
        x = jnp.where(x >= threshold, x, _FILTERED)
    return x


def select_tokens(logits: jax.Array, keys: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row and score it.

    Args:
      logits: float32 `[B, V]` raw next-token logits of the policy.
      keys: `[B]` typed PRNG keys (`row_keys`); unused when greedy.
      config: sampling settings (static); temperature 0 means greedy (argmax of `logits`).
    Returns:
      (tokens int32 `[B]`, logp float32 `[B]` under the policy at temperature 1 without
      truncation, sample_logp float32 `[B]` under the distribution sampled from, 0 if greedy).
    """
    if config.temperature == 0.0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        sample_logp = jnp.zeros(tokens.shape, jnp.float32)
    else:
        x = process_logits(logits, config)
        # vmap over rows so each row's draw uses only its own key (row independence).
        tokens = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        picked = jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]
        sample_logp = picked - jax.nn.logsumexp(x, axis=-1)
    logp, _ = logp_and_entropy_from_logits(logits, tokens)  # the trainer's numerics path
    return tokens, logp, sample_logp


# ---- prefill and the decode loop ----


def decode_windows(capacity: int, granularity: int) -> tuple[int, ...]:
    """The attention windows of the decode loops: W, 2W, ... below S, then S (W = granularity;
    just S when W is 0 or at least S)."""
    if granularity <= 0 or granularity >= capacity:
        return (capacity,)
    return tuple(range(granularity, capacity, granularity)) + (capacity,)


def prefill(
    model: CausalLM, cache: KVCache, logits: jax.Array, tokens: jax.Array, valid: jax.Array, reset: jax.Array
) -> tuple[KVCache, jax.Array]:
    """Append a right-padded chunk of rendered tokens to some rows; optionally restart rows.

    Args:
      model: the policy.
      cache: current cache, lengths `[B]`.
      logits: float32 `[B, V]` current next-token logits.
      tokens: int32 `[B, T]`; row b's real tokens first, then padding.
      valid: int32 `[B, T]` 1 on real tokens (a row with none is left as it is).
      reset: bool `[B]` start row b over (length 0) before appending: a new episode.
    Returns:
      (cache with lengths advanced by the real tokens per row, logits `[B, V]` updated on rows
      that received tokens, unchanged elsewhere).
    """
    cache = cache.replace(lengths=jnp.where(reset, 0, cache.lengths))
    new_logits, cache = model.prefill(tokens, cache, valid)
    got = jnp.any(valid > 0, axis=1)  # [B]
    return cache, jnp.where(got[:, None], new_logits, logits)


def copy_rows(cache: KVCache, src: jax.Array, lengths: jax.Array) -> KVCache:
    """Row b of the result is row `src[b]` of `cache` (every slot), filled to `lengths[b]`.

    How a new episode takes over a prompt prefix that a row already holds (its own previous
    episode or another row's) instead of prefilling it: the slots below `lengths[b]` hold
    the prefix's keys and values, the slots past it are never attended and get overwritten.

    Args: src int32 `[B]` (b itself for rows that keep their cache); lengths int32 `[B]`,
      negative: keep row src[b]'s length.
    """
    take = (lambda a: a[src]) if cache.per_layer else (lambda a: a[:, src])
    lengths = jnp.where(lengths >= 0, lengths, cache.lengths[src])
    return KVCache(k=jax.tree.map(take, cache.k), v=jax.tree.map(take, cache.v), lengths=lengths)


def prefill_rows(
    model: CausalLM, cache: KVCache, logits: jax.Array, rows: jax.Array, tokens: jax.Array, valid: jax.Array,
    reset: jax.Array,
) -> tuple[KVCache, jax.Array]:
    """`prefill` on R of the B rows: gather their cache rows, append, scatter them back.

    A flush where a few rows received a tool result then costs what those rows hold, not what
    the whole batch holds; the gather and scatter copy R rows of the cache, which is cheap
    next to running the model on B rows of padding.

    Args:
      rows: int32 `[R]` distinct row indices (R == B: all rows, and then `rows` is ignored).
      tokens, valid: `[R, T]`, reset `[R]`: as in `prefill`, for those rows in that order
        (a row with no valid token and no reset is left as it is).
      cache, logits: the whole batch, `[B, ...]`.
    Returns:
      (cache, logits) of the whole batch, changed only in the prefilled rows.
    """
    if tokens.shape[0] == logits.shape[0]:
        return prefill(model, cache, logits, tokens, valid, reset)
    take = (lambda a: a[rows]) if cache.per_layer else (lambda a: a[:, rows])
    sub = KVCache(k=jax.tree.map(take, cache.k), v=jax.tree.map(take, cache.v), lengths=cache.lengths[rows])
    sub, sub_logits = prefill(model, sub, logits[rows], tokens, valid, reset)
    if cache.per_layer:
        put = lambda a, new: a.at[rows].set(new)  # noqa: E731
    else:
        put = lambda a, new: a.at[:, rows].set(new)  # noqa: E731
    cache = KVCache(k=jax.tree.map(put, cache.k, sub.k), v=jax.tree.map(put, cache.v, sub.v),
                    lengths=cache.lengths.at[rows].set(sub.lengths))
    return cache, logits.at[rows].set(sub_logits)


def generate(
    model: CausalLM,
    cache: KVCache,
    logits: jax.Array,
    base_seed: jax.Array,
    episode_seeds: jax.Array,
    active: jax.Array,
    max_new: jax.Array,
    stop_ids: jax.Array,
    *,
    config: SamplingConfig,
    skip_empty_windows: bool = True,
    rows: jax.Array | None = None,
) -> tuple[TurnOutput, KVCache, jax.Array]:
    """Sample one turn for every active row with a `lax.while_loop` over decode steps.

    Each step draws a token per live row from `logits`, records it, and feeds it through
    `model.decode_step`, so the cache holds every sampled token (the stop token included)
    and the returned logits predict the token after it. Steps attend only to the smallest
    window of `decode_windows` holding every live row (masked slots past a row's length add
    nothing to its softmax: a window changes logits only by the rounding of the reductions).
    A row stops after sampling one of its stop ids or `max_new[b]` tokens; the loop ends
    when every row has stopped or after N = config.max_new_tokens steps. Finished and
    inactive rows stand still: their cache lengths and logits do not change.

    Args:
      model: the policy.
      cache: lengths `[B]`; the caller guarantees `lengths + max_new <= S`.
      logits: float32 `[B, V]` next-token logits (from `prefill` or a previous turn).
      base_seed: uint32 scalar; episode_seeds: uint32 `[B]` (see `row_keys`).
      active: bool `[B]` rows that sample this turn.
      max_new: int32 `[B]` per-row token budget, at most N.
      stop_ids: int32 `[B, M]` per-row stop sets, padded with -1.
      config: sampling settings (static).
      skip_empty_windows: skip a window no live row fits in (its loop would run no step);
        False copies every window in and out, the former loop (kept for
        benchmarks/bench_decode_windows.py).
      rows: int32 `[R]` distinct rows holding every active row (the others among them stand
        still); each window's copy gathers their slots and the copy back scatters them (the
        last window, the whole cache, is copied too), so the loop runs on R rows and a step
        costs what they decode (its time grows with its rows: benchmarks/profile_decode.py
        --batch). A row's tokens are the same either way: its sampling keys depend on its
        seed and position only, and no row's logits read another row. None or R == B: all
        B rows; rows outside `rows` sample nothing and are unchanged.
    Returns:
      (TurnOutput with `[B, N]` tokens and log-probs, the new cache, the new logits `[B, V]`).
    """
    whole_b, whole_logits, n = logits.shape[0], logits, config.max_new_tokens
    if rows is not None and rows.shape[0] == whole_b:
        rows = None
    if rows is not None:
        logits, episode_seeds, active, max_new, stop_ids = (
            logits[rows], episode_seeds[rows], active[rows], max_new[rows], stop_ids[rows])
    b = logits.shape[0]

    def cond(carry, window, whole=False):
        step, cache, _, done, *_ = carry
        # `whole`: the carry holds the whole cache (between windows), not a loop's rows.
        lengths = cache.lengths[rows] if whole and rows is not None else cache.lengths
        # The next step writes slot lengths[b] of every live row: it must lie inside the window.
        fits = jnp.max(jnp.where(done, 0, lengths)) < window
        return (step < n) & ~jnp.all(done) & fits

    def body(carry, window):
        step, cache, logits, done, num_new, stopped, out_tok, out_lp, out_slp = carry
        live = ~done  # [B]
        keys = row_keys(base_seed, episode_seeds, cache.lengths)
        tok, lp, slp = select_tokens(logits, keys, config)  # [B] each
        out_tok = out_tok.at[:, step].set(jnp.where(live, tok, PAD_ID))
        out_lp = out_lp.at[:, step].set(jnp.where(live, lp, 0.0))
        out_slp = out_slp.at[:, step].set(jnp.where(live, slp, 0.0))
        # Every sampled token enters the cache now, so the next turn can append right after it.
        next_logits, cache = model.decode_step(jnp.where(live, tok, 0), cache, live.astype(jnp.int32), window)
        logits = jnp.where(live[:, None], next_logits, logits)
        num_new = num_new + live.astype(jnp.int32)
        hit_stop = live & jnp.any(tok[:, None] == stop_ids, axis=1)
        stopped = stopped | hit_stop
        done = done | hit_stop | (num_new >= max_new)
        return step + 1, cache, logits, done, num_new, stopped, out_tok, out_lp, out_slp

    init = (
        jnp.int32(0), cache, logits, ~active | (max_new <= 0),
        jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
        jnp.full((b, n), PAD_ID, jnp.int32), jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n), jnp.float32),
    )

    def windowed_loop(carry, window):
        full = carry[1]
        carry = (carry[0], kv_cache.window(full, window, rows), *carry[2:])
        carry = jax.lax.while_loop(partial(cond, window=window), partial(body, window=None), carry)
        return (carry[0], kv_cache.put_window(full, carry[1], rows), *carry[2:])

    carry = init
    # One loop per window, narrowest first: each runs until a live row outgrows its window (or
    # the turn ends), then the next, wider one carries on; the last covers the whole cache.
    # A loop carries only its window's slots (`kv_cache.window`, one copy in and one out per
    # window and turn), so no step slices the full cache (benchmarks/profile_decode.py). A
    # window no live row fits in (late in an episode) is skipped, copies included: its loop
    # would run no step, and the copy out would only write back what the copy in read.
    for window in decode_windows(cache.capacity, config.decode_window):
        if window >= cache.capacity and rows is None:  # the whole cache: no copy to skip
            carry = jax.lax.while_loop(partial(cond, window=window), partial(body, window=None), carry)
        elif not skip_empty_windows:
            carry = windowed_loop(carry, window)
        else:
            carry = jax.lax.cond(cond(carry, window, whole=True), partial(windowed_loop, window=window),
                                 lambda c: c, carry)
    _, cache, logits_r, _, num_new, stopped, out_tok, out_lp, out_slp = carry
    out = TurnOutput(tokens=out_tok, logp=out_lp, sample_logp=out_slp, num_new=num_new, stopped=stopped)
    if rows is None:
        return out, cache, logits_r
    out = TurnOutput(  # back to the whole batch: the other rows sampled nothing
        tokens=jnp.full((whole_b, n), PAD_ID, jnp.int32).at[rows].set(out.tokens),
        logp=jnp.zeros((whole_b, n), jnp.float32).at[rows].set(out.logp),
        sample_logp=jnp.zeros((whole_b, n), jnp.float32).at[rows].set(out.sample_logp),
        num_new=jnp.zeros((whole_b,), jnp.int32).at[rows].set(out.num_new),
        stopped=jnp.zeros((whole_b,), bool).at[rows].set(out.stopped),
    )
    return out, cache, whole_logits.at[rows].set(logits_r)


# ---- jitted entry points over a split model ----


def make_sampler_fns(graphdef: nnx.GraphDef, config: SamplingConfig):
    """Jit `prefill` and `generate` as functions of the model's state (params) pytree, each a
    `program_store.StoredJit` (called like the jit; with the persistent compilation cache on, a
    later process loads its programs without tracing them).

    The params are an argument, not a closure constant, so a new set of params with the same
    shapes and dtypes (every RL iteration) reuses the compiled code. The cache and logits
    buffers are donated: the caller must use the returned ones.

    Returns:
      (prefill_fn(state, cache, logits, rows [R], tokens [R, T], valid [R, T], reset [R]) -> (cache, logits),
       generate_fn(state, cache, logits, rows [R], base_seed, episode_seeds [B], active [B], max_new [B],
                   stop_ids [B, M]) -> (TurnOutput, cache, logits)).
      R and T are whatever row count and chunk length are passed (`prefill_rows`, `generate`'s
      rows): one compilation per distinct (R, T) and per decode R (the engine passes only
      bucket sizes).
    """

    def prefill_fn(state, cache, logits, rows, tokens, valid, reset):
        return prefill_rows(nnx.merge(graphdef, state), cache, logits, rows, tokens, valid, reset)

    def generate_fn(state, cache, logits, rows, base_seed, episode_seeds, active, max_new, stop_ids):
        return generate(nnx.merge(graphdef, state), cache, logits, base_seed, episode_seeds, active, max_new,
                        stop_ids, config=config, rows=rows)

    # Kept on disk by shapes (program_store.py): a warm start loads them without tracing.
    return (StoredJit(prefill_fn, "prefill", graphdef, donate_argnums=(1, 2)),
            StoredJit(generate_fn, "decode", (graphdef, config), donate_argnums=(1, 2)))
