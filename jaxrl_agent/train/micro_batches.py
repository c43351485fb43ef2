"""DEVICE: how a train batch's rows split into micro- and mini-batches (train/step.py's layout).

    TrainBatch [B, ...] rows  --split(x, n)-->  [n, B/n, ...]   micro-batch k: rows k, k+n, ...
    shared leaves (prefixes, packed rows)  -->  whole, beside every micro-batch (SHARED)

Every data shard holds its share of every micro-batch, so splitting moves nothing between
devices. The shared prefixes and the packed rows are not rows: every micro- and mini-batch
keeps all of them (its rows index into them), and only the `[B, ...]` leaves are split or
gathered; `SHARED` is the one list of those fields.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_agent.structs import TrainBatch

SHARED = ("prefix_tokens", "prefix_mask", "pack_tokens", "pack_positions", "pack_segments")


def split(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...]; micro-batch k holds rows k, k + n, ..., so every data shard
    holds its share of every micro-batch (no cross-device traffic to split)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def unsplit(x: jax.Array) -> jax.Array:
    """Inverse of `split`: [n, B/n, ...] -> [B, ...]."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def rows_and_shared(batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """(`batch` with only its row leaves, its shared prefixes and packed rows by field name)."""
    return batch.replace(**dict.fromkeys(SHARED)), {k: getattr(batch, k) for k in SHARED}


def map_rows(fn: Callable, batch: TrainBatch) -> TrainBatch:
    """`fn` applied to every row leaf of `batch`; the shared prefixes and packed rows stay as they are."""
    rows, shared = rows_and_shared(batch)
    return jax.tree.map(fn, rows).replace(**shared)


def split_rows(batch: TrainBatch, n: int) -> tuple[TrainBatch, dict]:
    """(row leaves split into n micro-batches; the shared leaves): what a
    `lax.map` / `lax.scan` over micro-batches takes as xs and as a constant."""
    rows, shared = rows_and_shared(batch)
    return jax.tree.map(lambda x: split(x, n), rows), shared
