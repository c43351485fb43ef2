"""HOST: the multi-turn sampling engine: episodes in rows, continuous batching, shape buckets.

`SamplingEngine` owns a batch of B rows on device (`decode.py`: a KV cache and next-token
logits) and a host mirror of each row's tokens. A rollout loop talks to it per turn:

    eng = SamplingEngine(model, SamplingConfig(batch_size=B, cache_size=S, stop_token_ids=(im_end,)))
    eng.warmup()                                   # compile every bucket once (optional)
    eng.start_episode(row, prompt_ids, seed=k)     # new episode in a row (refill = the same call)
    turn = eng.sample_turn()                       # all rows holding an episode sample one turn
    ids, logp, sample_logp = turn.row(row)         # what the policy said, with its log-probs
    eng.begin_turn(rows); turn = eng.advance(16)   # or: up to 16 steps at a time, rows whose
                                                   #   turn ended come back (turn.finish_reason)
    eng.append(row, observation_ids)               # tool result + template glue: prefill only these
    eng.end_episode(row)                           # the row is free (or start_episode again)
    eng.update_params(model)                       # after an optimiser step; no recompilation

`sample_turn` is `begin_turn` + one `advance` long enough for every turn to end. An agent loop
calls `advance` in chunks instead (`agent/rollout.py`): a row whose turn ends mid-chunk leaves the
decode batch at the chunk's end for its tool call, and rows whose tool results arrive begin
their next turn, so the decode loop runs on rows mid-turn rather than on a turn's stragglers.

Text staged by `start_episode` / `append` is prefilled lazily by the next `advance` (or
`flush`): in the prefill calls (row bucket x length bucket, each on just some of the staged
rows) that `prefill_plan.plan_prefill` finds cheapest, so a flush costs what was staged, not B
rows of the longest chunk. A decode call likewise runs on the rows in a turn, gathered into the smallest
decode row bucket that holds them. Only bucketed shapes ever reach the compiled functions: one
prefill per (row bucket, length bucket) and one decode loop per decode row bucket, so after
`warmup` a whole multi-turn rollout (and every later iteration with new params) compiles
nothing. Bad input raises a ValueError at the call that caused it, before any state changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agent.config import SamplingConfig
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.sampling.decode import copy_rows, make_sampler_fns
from jaxrl_agent.sampling.engine_config import check_config, check_fits, check_ids, row_buckets, stop_row
from jaxrl_agent.sampling.prefill_plan import PrefillCall, plan_prefill
from jaxrl_agent.sampling.prefix_sources import prefix_sources


@dataclass(frozen=True)
class TurnResult:
    """One `sample_turn`, as host NumPy arrays (`[B, N]` slots past `num_new[b]` are padding)."""

    tokens: np.ndarray
    """int32 `[B, N]` sampled ids (-1 padding)."""
    logp: np.ndarray
    """float32 `[B, N]` policy log-probs (temperature 1, no truncation) == the trainer's logp."""
    sample_logp: np.ndarray
    """float32 `[B, N]` log-probs under the distribution actually sampled from."""
    num_new: np.ndarray
    """int32 `[B]` tokens sampled per row (0 for rows that did not sample)."""
    stopped: np.ndarray
    """bool `[B]` the row ended its turn on a stop token."""
    finish_reason: tuple[str | None, ...]
    """Per row: "stop", "length" (max new tokens), "cache_full" (no slot left), None (not sampled)."""

    def row(self, b: int) -> tuple[list[int], list[float], list[float]]:
        """Row b's sampled ids, policy log-probs and sampling log-probs, as Python lists."""
        n = int(self.num_new[b])
        return self.tokens[b, :n].tolist(), self.logp[b, :n].tolist(), self.sample_logp[b, :n].tolist()


class SamplingEngine:
    """B rows of independent episodes sharing one jitted prefill and one jitted decode loop."""

    def __init__(self, model: CausalLM, config: SamplingConfig):
        """Split `model` into graphdef + params and allocate an empty cache of B x S slots."""
        check_config(config, model.config.vocab_size)
        self.config = config
        self.vocab_size = model.config.vocab_size
        graphdef, self.state = nnx.split(model)
        self._prefill_fn, self._generate_fn = make_sampler_fns(graphdef, config)
        self._copy_fn = jax.jit(copy_rows, donate_argnums=0)
        b, s = config.batch_size, config.cache_size
        self.cache = model.init_cache(b, s)
        self.logits = jnp.zeros((b, self.vocab_size), jnp.float32)
        self.buckets = tuple(sorted(config.prefill_buckets))
        self.row_buckets = row_buckets(config)
        self.decode_row_buckets = row_buckets(config, decode=True)
        self._base_seed = np.uint32(config.seed % 2**32)
        # ---- host mirror: what each row holds and what is staged for it ----
        self._tokens: list[list[int]] = [[] for _ in range(b)]  # ids in the cache (+ staged)
        self._staged: list[list[int]] = [[] for _ in range(b)]  # rendered ids not yet prefilled
        self._reset = np.zeros(b, bool)  # restart the row at the next prefill
        self._live = np.zeros(b, bool)  # the row holds an episode
        self._seeds = np.zeros(b, np.uint32)
        self._stop = np.full((b, config.max_stop_tokens), -1, np.int32)
        # leading ids of _tokens[b] whose keys/values are in the device cache (a freed row keeps
        # its cache: a new episode can copy a prefix from it), and copies flush will make first
        self._cached = np.zeros(b, np.int64)
        self._copy_src = np.full(b, -1, np.int64)  # copy from a cached prefix, before prefilling
        self._copy_len = np.zeros(b, np.int64)
        self._follow_src = np.full(b, -1, np.int64)  # copy from a prompt staged in the same flush
        self._follow_len = np.zeros(b, np.int64)
        self._episodes_started = 0
        # ---- turns in progress (begin_turn / advance): budget and what was sampled so far ----
        self._in_turn = np.zeros(b, bool)
        self._turn_n = np.zeros(b, np.int64)
        self._turn_out: list[tuple[list, list, list] | None] = [None] * b
        # ---- counters (benchmarks): tokens that entered the cache, and prefill compute incl. padding ----
        self.tokens_prefilled = 0
        self.tokens_prefill_padded = 0
        self.prefill_slots = 0  # rows x length of every prefill call (padding rows included)
        self.tokens_decoded = 0
        self.tokens_shared = 0  # prompt tokens copied from a cached prefix instead of prefilled
        self.decode_steps = 0  # decode loop iterations
        self.decode_row_steps = 0  # rows the decode loops ran, summed over their steps (padding included)

    # ---- params ----

    def update_params(self, params: CausalLM | nnx.State) -> None:
        """Use new params (a model or its `nnx.state`): no recompilation while their shapes,
        dtypes and shardings stay those of the params the engine was built with."""
        state = nnx.state(params) if isinstance(params, nnx.Module) else params
        if jax.tree.structure(state) != jax.tree.structure(self.state):
            raise ValueError("update_params: the new params do not have the structure of the engine's model")
        # Cached prefixes hold the old params' keys and values: no new episode may copy them.
        # A copy still pending becomes a prefill of the whole prompt under the new params
        # (when that fits one chunk; otherwise it is made now, like any row that is mid-episode
        # across an update).
        pending = self._copy_src >= 0
        if any(len(self._tokens[r]) > self.buckets[-1] for r in np.flatnonzero(pending)):
            self.flush()
        for r in np.flatnonzero(self._copy_src >= 0):
            self._staged[r], self._reset[r], self._copy_src[r] = list(self._tokens[r]), True, -1
        self._cached[:] = 0
        self.state = state

    # ---- rows ----

    def start_episode(self, row: int, prompt_ids: Sequence[int], *, seed: int | None = None,
                      stop_ids: Sequence[int] | None = None) -> None:
        """Put a new episode in `row` (discarding whatever it held): the continuous-batching refill.

        Args:
          row: 0 <= row < B.
          prompt_ids: the rendered prompt, 1 <= len <= min(S, largest bucket).
          seed: the episode's seed; its tokens depend only on (config.seed, seed, the ids), not
            on the row or the other rows. Default: the number of episodes started so far.
          stop_ids: this row's stop set (default `config.stop_token_ids`), at most M ids.
        """
        self._check_row(row)
        prompt = check_ids(prompt_ids, "prompt_ids", self.vocab_size)
        if not prompt:
            raise ValueError(f"start_episode(row={row}): the prompt is empty")
        check_fits(row, len(prompt), len(prompt), "prompt", self.config.cache_size, self.buckets)
        stops = stop_row(self.config.stop_token_ids if stop_ids is None else stop_ids, self.config.max_stop_tokens,
                         self.vocab_size)
        seed = self._episodes_started if seed is None else seed
        if (self._follow_src == row).any():
            self.flush()  # rows waiting to copy this row's staged prompt get it before it changes
        (src, n), (lead, m) = prefix_sources(prompt, row, self._tokens, self._cached, self._live, self._staged,
                                             self.config.share_prefix_min)
        n_all = max(n, m)
        self._tokens[row], self._staged[row] = list(prompt), list(prompt[n_all:])
        self._reset[row], self._live[row] = n_all == 0, True
        self._cached[row] = 0
        self._copy_src[row], self._copy_len[row] = (src, n) if n and n >= m else (-1, 0)
        self._follow_src[row], self._follow_len[row] = (lead, m) if m > n else (-1, 0)
        self._in_turn[row], self._turn_out[row] = False, None
        self._seeds[row] = np.uint32(int(seed) % 2**32)
        self._stop[row] = stops
        self._episodes_started += 1

    def append(self, row: int, ids: Sequence[int]) -> None:
        """Append rendered tokens (a tool result, template glue) to the episode in `row`.

        They are prefilled into the row's cache by the next `sample_turn`/`flush` (or right
        away, when the staged text would outgrow the largest bucket); nothing already in the
        cache is recomputed. A single chunk longer than the largest bucket is an error.
        """
        self._check_row(row)
        if not self._live[row]:
            raise ValueError(f"append(row={row}): the row holds no episode (call start_episode first)")
        if self._in_turn[row]:
            raise ValueError(f"append(row={row}): the row is in a turn (advance until it ends, then append)")
        ids = check_ids(ids, "ids", self.vocab_size)
        check_fits(row, len(self._tokens[row]) + len(ids), len(ids), "append", self.config.cache_size,
                   self.buckets)
        if (self._follow_src == row).any():
            self.flush()  # rows copying this row's staged prompt (and its logits) get it before it grows
        if len(self._staged[row]) + len(ids) > self.buckets[-1]:
            self.flush()  # staged text would outgrow the largest bucket: prefill what is staged first
        self._tokens[row].extend(ids)
        self._staged[row].extend(ids)

    def end_episode(self, row: int) -> None:
        """Mark `row` free; `sample_turn` skips it until `start_episode` refills it."""
        self._check_row(row)
        if (self._follow_src == row).any():
            self.flush()  # rows waiting to copy this row's staged prompt get it first
        self._live[row] = False
        self._staged[row] = []
        self._in_turn[row], self._turn_out[row] = False, None

    def tokens(self, row: int) -> list[int]:
        """The full token sequence of the episode in `row` (rendered + sampled, in order)."""
        self._check_row(row)
        return list(self._tokens[row])

    def free_rows(self) -> list[int]:
        """Rows holding no episode (ready for `start_episode`)."""
        return [int(b) for b in np.flatnonzero(~self._live)]

    # ---- device calls ----

    def flush(self) -> None:
        """Prefill every staged chunk, in the calls `prefill_plan.plan_prefill` picks.

        Shared prompt prefixes (`start_episode`) are copied first from rows whose cache held
        them before this flush; rows sharing with a prompt staged in this same flush (a
        group's episodes starting together) copy it once it is in the cache, then prefill the
        rest of their own prompt: in rounds, as a row followed may itself follow another."""
        b = self.config.batch_size
        first = self._copy_src >= 0
        if first.any():  # from the cache as it is before this flush's prefills
            self._copy(first, self._copy_src, self._copy_len)
        lens = np.array([len(s) for s in self._staged])
        waiting = self._follow_src >= 0
        self._prefill((lens > 0) & ~waiting, lens)
        while waiting.any():  # rounds: a row follows once its source's prompt is in the cache
            ready = waiting & ~waiting[np.maximum(self._follow_src, 0)]
            if not ready.any():  # sources were staged before their followers: never a cycle
                raise RuntimeError(f"follow cycle among rows {np.flatnonzero(waiting).tolist()}")
            self._copy(ready, self._follow_src, self._follow_len)
            # a copy of a whole identical prompt takes the source's next-token logits too
            # (a follower appended to since then prefills its own text: its logits are from that)
            whole = ready & (self._follow_len == np.array([len(t) for t in self._tokens]))
            if whole.any():
                self.logits = self.logits[np.where(whole, self._follow_src, np.arange(b)).astype(np.int32)]
            self._prefill(ready, lens)
            waiting &= ~ready
        self._cached = np.array([len(t) if live else c for t, live, c in zip(self._tokens, self._live, self._cached)])
        self._copy_src[:], self._follow_src[:] = -1, -1
        self.tokens_prefilled += int(lens.sum())
        self._staged = [[] for _ in range(b)]
        self._reset[:] = False

    def _copy(self, rows: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
        """Device: rows[b] takes the first n[b] slots of row src[b]'s cache (`sampling.copy_rows`)."""
        keep = np.arange(self.config.batch_size)
        self.cache = self._copy_fn(self.cache, np.where(rows, src, keep).astype(np.int32),
                                   np.where(rows, n, -1).astype(np.int32))
        self.tokens_shared += int(n[rows].sum())

    def _prefill(self, rows: np.ndarray, lens: np.ndarray) -> None:
        """Device: prefill the staged chunk of every row in the mask `rows`, in the calls
        `prefill_plan.plan_prefill` picks (the least padded work over the compiled shapes)."""
        # check_fits guarantees every chunk has a bucket.
        staged = {int(b): int(lens[b]) for b in np.flatnonzero(rows & (lens > 0))}
        for call in self._plan(staged):
            r, t, group, mine = call.num_rows, call.length, list(call.rows), set(call.rows)
            # Pad with other rows, distinct so the scatter back is well defined: no valid
            # token and no reset leaves them as they are.
            order = group + [b for b in range(self.config.batch_size) if b not in mine]
            order = np.array(order[:r] if r < self.config.batch_size else sorted(order), np.int32)
            tokens = np.zeros((r, t), np.int32)  # [R, T]
            valid = np.zeros((r, t), np.int32)
            reset = np.zeros(r, bool)
            for i, b in enumerate(order):
                if int(b) in mine:
                    tokens[i, : lens[b]] = self._staged[b]
                    valid[i, : lens[b]] = 1
                    reset[i] = self._reset[b]
            self.cache, self.logits = self._prefill_fn(self.state, self.cache, self.logits, order, tokens, valid, reset)
            self.tokens_prefill_padded += len(group) * t
            self.prefill_slots += r * t

    def _plan(self, staged: dict[int, int]) -> list[PrefillCall]:
        """The prefill calls of one flush ({row: staged tokens}); a benchmark's former plan
        overrides it (benchmarks/bench_prefill_plan.py)."""
        return plan_prefill(staged, self.row_buckets, self.buckets)

    def sample_turn(self, rows: Sequence[int] | None = None, *, max_new_tokens: int | None = None) -> TurnResult:
        """Sample one whole turn for `rows` (default: every row holding an episode), in one loop.

        Each row samples until one of its stop ids (kept, "stop"), `max_new_tokens` tokens
        ("length", default and upper bound `config.max_new_tokens`) or the end of its cache
        ("cache_full"). The sampled ids are appended to the row's episode and cache.
        Returns: a `TurnResult` with `[B, N]` arrays, N = config.max_new_tokens.
        """
        rows = [int(b) for b in np.flatnonzero(self._live & ~self._in_turn)] if rows is None else rows
        self.begin_turn(rows, max_new_tokens=max_new_tokens)
        return self.advance(self.config.max_new_tokens)  # every budget is at most N: all turns end

    def begin_turn(self, rows: Sequence[int], *, max_new_tokens: int | None = None) -> None:
        """Start a turn in `rows`: each samples in the following `advance` calls until its turn
        ends (a stop id, `max_new_tokens` (default `config.max_new_tokens`), or a full cache).

        Rows begin and end turns independently, so a caller can decode a few steps at a time
        and hand a row back to its tools the moment its turn ends, while the other rows go on
        decoding: the decode batch holds rows mid-turn, not rows waiting for the slowest one.
        """
        n = self.config.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= n <= self.config.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be in [1, config.max_new_tokens={self.config.max_new_tokens}]")
        rows = [int(r) for r in rows]
        for r in rows:
            self._check_row(r)
            if not self._live[r]:
                raise ValueError(f"begin_turn: row {r} holds no episode")
            if self._in_turn[r]:
                raise ValueError(f"begin_turn: row {r} is already in a turn (call advance until it ends)")
        for r in rows:
            self._in_turn[r], self._turn_n[r], self._turn_out[r] = True, n, ([], [], [])

    def advance(self, max_steps: int) -> TurnResult:
        """Decode up to `max_steps` tokens in every row that is in a turn (`begin_turn`).

        Returns: a `TurnResult` for the rows whose turn ended in this call: their whole turn's
        ids and log-probs (gathered over the calls it took) and finish reason; every other row
        has `num_new` 0 and reason None. A row's tokens depend only on its seed and contents,
        never on how its turn was split into calls (the sampling keys are keyed by position).
        """
        cfg = self.config
        if max_steps < 1:
            raise ValueError(f"advance: max_steps={max_steps} must be >= 1")
        self.flush()
        in_turn = self._in_turn.copy()
        room = cfg.cache_size - np.array([len(t) for t in self._tokens])  # free slots per row
        left = self._turn_n - np.array([len(o[0]) if o else 0 for o in self._turn_out])
        budget = np.where(in_turn, np.minimum(np.minimum(left, room), max_steps), 0).astype(np.int32)  # [B]
        sampling = in_turn & (budget > 0)
        if sampling.any():
            rows = self._decode_rows(sampling)
            out, self.cache, self.logits = self._generate_fn(
                self.state, self.cache, self.logits, rows, self._base_seed, self._seeds.copy(), sampling,
                budget, self._stop.copy(),
            )
            out = jax.device_get(out)
            num_new, stopped = np.asarray(out.num_new), np.asarray(out.stopped)
            self.decode_steps += int(num_new.max())
            self.decode_row_steps += int(num_new.max()) * len(rows)
        else:  # every turn in progress is out of room: they end "cache_full" without a step
            out, num_new, stopped = None, np.zeros(cfg.batch_size, np.int32), np.zeros(cfg.batch_size, bool)
        n = cfg.max_new_tokens
        tokens, logp = np.full((cfg.batch_size, n), -1, np.int32), np.zeros((cfg.batch_size, n), np.float32)
        sample_logp, done_new = np.zeros_like(logp), np.zeros(cfg.batch_size, np.int32)
        reasons: list[str | None] = [None] * cfg.batch_size
        for b in np.flatnonzero(in_turn):
            k = int(num_new[b])
            ids, lps, slps = self._turn_out[b]
            if k:
                self._cached[b] += k
                ids += out.tokens[b, :k].tolist()
                lps += out.logp[b, :k].tolist()
                slps += out.sample_logp[b, :k].tolist()
                self._tokens[b].extend(out.tokens[b, :k].tolist())
            if stopped[b]:
                reasons[b] = "stop"
            elif len(ids) >= self._turn_n[b]:
                reasons[b] = "length"
            elif len(self._tokens[b]) >= cfg.cache_size:
                reasons[b] = "cache_full"
            else:
                continue  # the turn goes on in the next call
            m = len(ids)
            tokens[b, :m], logp[b, :m], sample_logp[b, :m], done_new[b] = ids, lps, slps, m
            self._in_turn[b], self._turn_out[b] = False, None
        self.tokens_decoded += int(num_new.sum())
        return TurnResult(tokens=tokens, logp=logp, sample_logp=sample_logp, num_new=done_new,
                          stopped=np.array([r == "stop" for r in reasons]), finish_reason=tuple(reasons))

    def in_turn(self) -> list[int]:
        """Rows in a turn that has not ended yet (`begin_turn`, `advance`)."""
        return [int(b) for b in np.flatnonzero(self._in_turn)]

    def warmup(self) -> None:
        """Compile the prefill of every (row bucket, length bucket) and the decode loop of every
        decode row bucket without changing any row."""
        b = self.config.batch_size
        for r in self.row_buckets:
            rows = np.arange(r, dtype=np.int32)
            for t in self.buckets:
                zeros = np.zeros((r, t), np.int32)  # no valid token: no row changes
                self.cache, self.logits = self._prefill_fn(self.state, self.cache, self.logits, rows, zeros, zeros,
                                                           np.zeros(r, bool))
        rows = np.arange(b, dtype=np.int32)
        self.cache = self._copy_fn(self.cache, rows, np.full(b, -1, np.int32))  # every row keeps its cache
        none = np.zeros(b, bool)
        for r in self.decode_row_buckets:
            _, self.cache, self.logits = self._generate_fn(
                self.state, self.cache, self.logits, rows[:r], self._base_seed, self._seeds.copy(), none,
                np.zeros(b, np.int32), self._stop.copy(),
            )

    def num_compiled(self) -> int:
        """Compiled variants of the prefill, decode and prefix-copy functions so far (one per
        (row bucket, length bucket) used, one per decode row bucket used, + 1)."""
        return self._prefill_fn._cache_size() + self._generate_fn._cache_size() + self._copy_fn._cache_size()

    # ---- validation ----

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.config.batch_size:
            raise ValueError(f"row {row} out of range [0, batch_size={self.config.batch_size})")

    def _decode_rows(self, sampling: np.ndarray) -> np.ndarray:
        """The rows of one decode call: every sampling row, then rows that stand still up to the
        smallest decode row bucket that holds them (all B rows when that is B)."""
        live = np.flatnonzero(sampling)
        r = next(n for n in self.decode_row_buckets if n >= len(live))
        if r == self.config.batch_size:
            return np.arange(r, dtype=np.int32)
        return np.concatenate([live, np.flatnonzero(~sampling)[: r - len(live)]]).astype(np.int32)
