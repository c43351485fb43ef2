"""HOST: how a collated batch's rows go through the model with less repeated or padded work.

`trajectory.collate` pads one episode per row; this module adds the optional leaves that let
the model skip work and the per-row outputs stay the same (up to float summation order):

    rows [B, T] --shared prefixes (share_prefix_min)--> + prefix_tokens [P, Tp], prefix_index [B]
                  a GRPO group's common loss-free start runs once; each row keeps the rest
    rows [B, T] --packed forward (pack_forward)-------> + pack_tokens [Pk, Tk], pack_slot [B, T]
                  the model runs the rows packed several to a row; outputs read back per row

Both leave every `[B, T]` field a loss reads as it was (one episode per row). The shapes they
add are bucketed (`fit_count`) so a run compiles a bounded number of train steps. One home for
the rules of each: which tokens a group shares (`shared_prefixes`), how rows pack
(`pack_rows`, first-fit decreasing, also `TrajectoryConfig.pack`'s SFT rows).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxrl_agent.config import TrajectoryConfig
from jaxrl_agent.structs import TrainBatch


def fit_count(needed: int, allowed: Sequence[int], multiple: int, name: str) -> int:
    """The smallest of `allowed` (each a multiple of `multiple`) that holds `needed`, or with
    none allowed the smallest multiple of `multiple` that does (at least one)."""
    if allowed:
        if any(r % multiple for r in allowed):
            raise ValueError(f"{name} {tuple(allowed)} must be multiples of batch_multiple={multiple}")
        fit = [r for r in sorted(allowed) if r >= needed]
        if not fit:
            raise ValueError(f"{needed} rows exceed the largest of {name} {tuple(allowed)}")
        return fit[0]
    return -(-max(needed, 1) // multiple) * multiple


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of episode lengths into rows of `capacity` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return [sorted(r) for r in rows]


# ---- shared prefixes ----
def shared_prefixes(eps: Sequence, min_len: int, max_len: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Which prefix each episode continues, and where its row starts.

    A group (`group_id`) of at least two episodes shares the longest start all of them have
    in common that holds no loss token; its prefix is that start minus its last token (which
    each row keeps), cut to at most `max_len` tokens, if at least `min_len` long. Returns
    (prefix_of, cuts, prefixes): episode i continues `prefixes[prefix_of[i]]` and its row
    starts at token `cuts[i]` (prefix_of -1 and cut 0 for an episode that shares nothing).
    """
    members: dict[int, list[int]] = {}
    for i, ep in enumerate(eps):
        members.setdefault(ep.group_id, []).append(i)
    prefix_of, cuts, prefixes = [-1] * len(eps), [0] * len(eps), []
    for rows in members.values():
        if len(rows) < 2:
            continue
        first = eps[rows[0]].ids
        common = min(next((t for t, m in enumerate(eps[i].loss_mask) if m), len(eps[i])) for i in rows)
        for i in rows[1:]:
            ids, n = eps[i].ids, 0
            while n < common and ids[n] == first[n]:
                n += 1
            common = n
        cut = min(common - 1, max_len)
        if cut >= max(min_len, 1):
            for i in rows:
                prefix_of[i], cuts[i] = len(prefixes), cut
            prefixes.append(list(first[:cut]))
    return prefix_of, cuts, prefixes


def attach_prefixes(batch: TrainBatch, row_prefix: list[int], prefixes: list[list[int]], tp: int,
                    cfg: TrajectoryConfig) -> TrainBatch:
    """Add `prefix_tokens` / `prefix_mask` / `prefix_index` to a collated batch (`row_prefix`:
    each real row's prefix, -1 for none; `tp` the prefix bucket). P is padded to `prefix_rows`
    or the row multiple; a row that shares nothing, and every padding row, points at a prefix
    with no real token."""
    b = batch.tokens.shape[0]
    row_prefix = row_prefix + [-1] * (b - len(row_prefix))
    needed = len(prefixes) + (-1 in row_prefix)  # the empty prefix follows the real ones
    n_prefixes = fit_count(needed, cfg.prefix_rows, cfg.batch_multiple, "prefix_rows")
    prefix_tokens = np.full((n_prefixes, tp), cfg.pad_id, np.int32)
    prefix_mask = np.zeros((n_prefixes, tp), np.int32)
    for k, p in enumerate(prefixes):
        prefix_tokens[k, :len(p)] = p
        prefix_mask[k, :len(p)] = 1
    index = np.asarray([len(prefixes) if k < 0 else k for k in row_prefix], np.int32)
    return batch.replace(prefix_tokens=prefix_tokens, prefix_mask=prefix_mask, prefix_index=index)


# ---- packed forward ----
def attach_packing(batch: TrainBatch, cfg: TrajectoryConfig) -> TrainBatch:
    """Add `pack_tokens` / `pack_positions` / `pack_segments` / `pack_slot` to a collated batch
    of one left-aligned episode per row: the rows' real tokens first-fit-decreasing into rows
    of T tokens (Pk of them, padded to `pack_rows` or the row multiple), segment ids 1, 2, ...
    in each, positions as in the row; `pack_slot[b, t]` = where row b's token t went, flat
    (Pk * T for padding). A padding row packs nothing."""
    b, t = batch.tokens.shape
    lengths = (np.asarray(batch.attention_mask) > 0).sum(axis=1)
    real = [r for r in range(b) if lengths[r]]
    bins = [[real[i] for i in members] for members in pack_rows([int(lengths[r]) for r in real], t)]
    n_packed = fit_count(len(bins), cfg.pack_rows, cfg.batch_multiple, "pack_rows")
    tokens = np.full((n_packed, t), cfg.pad_id, np.int32)
    positions = np.zeros((n_packed, t), np.int32)
    segments = np.zeros((n_packed, t), np.int32)
    slot = np.full((b, t), n_packed * t, np.int32)
    for p, members in enumerate(bins):
        start = 0
        for seg, r in enumerate(members, start=1):
            n = int(lengths[r])
            tokens[p, start:start + n] = batch.tokens[r, :n]
            positions[p, start:start + n] = batch.positions[r, :n]
            segments[p, start:start + n] = seg
            slot[r, :n] = p * t + start + np.arange(n)
            start += n
    return batch.replace(pack_tokens=tokens, pack_positions=positions, pack_segments=segments, pack_slot=slot)
