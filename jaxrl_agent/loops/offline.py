"""HOST: offline training loops: SFT on episodes and DPO on preference pairs of episodes.

Both go through the same `TrainStep` as RL (only the LossFn differs: `LOSSES["sft"]`, the
masked NLL on assistant tokens, and `LOSSES["dpo"]` on rows 2i chosen / 2i+1 rejected with the
frozen reference policy filling `ref_logp`). The data iterator's position is checkpointed with
the state, so a run killed at any point resumes from its last checkpoint and reproduces the
uninterrupted run exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Sequence

import jax
import numpy as np

from jaxrl_agent.config import CheckpointConfig, OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.train import sharding as sh
from jaxrl_agent.train.checkpoint import Checkpointer
from jaxrl_agent.train.step import TrainState, TrainStep, make_optimizer, make_train_step
from jaxrl_agent.trajectory import Episode, collate, preference_pairs


# ---- data ----
class DataIterator:
    """Deterministic, resumable batches over a list: each epoch a fresh permutation seeded by
    (seed, epoch); `position()` / `restore()` capture where the next batch starts. A batch never
    straddles two epochs (the remainder of an epoch is dropped).

    `group_by_length=k` (with `lengths`, one per item) cuts padding the way HF's
    `group_by_length` does: the epoch's permutation is split into mega-batches of k batches,
    each sorted by length (longest first) and cut into batches, and the batches' order is
    permuted again. Every item still appears once per epoch (less the remainder) and batches
    stay random draws at the scale of a mega-batch, but a batch's rows have similar lengths,
    so the bucket `collate` pads a batch to is near its rows' own lengths
    (benchmarks/bench_sft_batching.py).
    """

    def __init__(self, items: Sequence, batch_size: int, seed: int = 0, shuffle: bool = True, *,
                 lengths: Sequence[int] | None = None, group_by_length: int = 0):
        if batch_size < 1 or batch_size > len(items):
            raise ValueError(f"batch_size must be in [1, {len(items)}] (number of items), got {batch_size}")
        if group_by_length < 0:
            raise ValueError(f"group_by_length must be >= 0 (0 or 1: off), got {group_by_length}")
        if group_by_length > 1 and (lengths is None or len(lengths) != len(items)):
            raise ValueError(f"group_by_length={group_by_length} needs one length per item "
                             f"(got {'none' if lengths is None else len(lengths)} for {len(items)} items)")
        # a Sequence is kept as given (env.tasks.GeneratedTasks makes an item when first read)
        items = items if isinstance(items, Sequence) else list(items)
        self.items, self.batch_size, self.seed, self.shuffle = items, batch_size, seed, shuffle
        self.lengths = None if group_by_length <= 1 else np.asarray(lengths)
        self.group = group_by_length
        self.epoch, self.index = 0, 0
        self._cache: tuple[int, np.ndarray] | None = None

    def _order(self) -> np.ndarray:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        n = len(self.items)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.lengths is not None:
            bs, mega = self.batch_size, self.batch_size * self.group
            order = order[:n - n % bs]  # the dropped remainder, as without grouping
            chunks = [order[i:i + mega] for i in range(0, len(order), mega)]
            order = np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")] for c in chunks])
            batches = order.reshape(-1, bs)
            perm = np.random.default_rng([self.seed, self.epoch, 1]).permutation(len(batches))
            order = batches[perm].reshape(-1)
        self._cache = (self.epoch, order)
        return order

    def next(self) -> list:
        """The next batch of items."""
        if self.index + self.batch_size > len(self._order()):
            self.epoch, self.index = self.epoch + 1, 0
        idx = self._order()[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return [self.items[i] for i in idx]

    def position(self) -> dict:
        pos = {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_items": len(self.items)}
        return pos | ({"group_by_length": self.group} if self.lengths is not None else {})

    def restore(self, pos: dict) -> None:
        if (pos.get("num_items") != len(self.items) or pos.get("seed") != self.seed
                or pos.get("group_by_length", 0) != (self.group if self.lengths is not None else 0)):
            raise ValueError(f"checkpointed data position {pos} does not match this dataset "
                             f"({len(self.items)} items, seed {self.seed}, group_by_length {self.group}): "
                             "resume with the run's own data and settings, or start a new checkpoint directory")
        self.epoch, self.index = int(pos["epoch"]), int(pos["index"])


# ---- the shared loop ----
def train_offline(
    model,
    items: Sequence,
    to_batch: Callable[[list, int], object],
    loss_name: str,
    *,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    num_steps: int,
    batch_size: int,
    ckpt_cfg: CheckpointConfig | None = None,
    seed: int = 0,
    mesh=None,
    on_step: Callable[[int, dict], None] | None = None,
    train_step: TrainStep | None = None,
    lengths: Sequence[int] | None = None,
    group_by_length: int = 0,
) -> tuple[TrainState, list[dict], TrainStep]:
    """Train `model` for `num_steps` steps of `LOSSES[loss_name]` on batches of `items`.

    `to_batch(items, rows_multiple)` collates a list of items into a TrainBatch whose row count
    is a multiple of `rows_multiple` (the mesh's data * fsdp devices).

    With `ckpt_cfg`, resumes from the latest checkpoint in its directory (state and data
    position), saves every `save_every` steps and at the end. `on_step(step, metrics)` is
    called after every step (logging; raising there stops the run like a kill would).
    `train_step` reuses an already compiled step built for `LOSSES[loss_name]` and `train_cfg`.
    `lengths` / `group_by_length`: batches of similar lengths (`DataIterator`).
    Returns (final state, per-step metrics as floats, the TrainStep).
    """
    step_fn = train_step or make_train_step(LOSSES[loss_name], make_optimizer(optim_cfg), train_cfg, model, mesh=mesh)
    if step_fn.loss_fn is not LOSSES[loss_name]:
        raise ValueError(f"train_step was built for another loss than {loss_name!r}")
    data = DataIterator(items, batch_size, seed=seed, lengths=lengths, group_by_length=group_by_length)
    ckpt = Checkpointer(ckpt_cfg) if ckpt_cfg is not None else None
    if ckpt is not None and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(step_fn.abstract_state())
        data.restore(meta["data_position"])
    else:
        state = step_fn.init_state(model, seed=seed)
    history: list[dict] = []
    try:
        start = int(jax.device_get(state.step))
        for step in range(start + 1, num_steps + 1):
            # ---- one batch -> one train step ----
            t0 = time.perf_counter()
            batch = to_batch(data.next(), sh.batch_size_multiple(step_fn.mesh))
            state, metrics = step_fn(state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            metrics["step_time_s"] = time.perf_counter() - t0
            history.append(metrics)
            # ---- checkpoint, then report (a crash in the report keeps the checkpoint) ----
            if ckpt is not None and (ckpt.should_save(step) or step == num_steps):
                ckpt.save(step, state, data_position=data.position(), config=train_cfg,
                          extra={"loss": loss_name, "optim": optim_cfg})
            if on_step is not None:
                on_step(step, metrics)
    finally:
        if ckpt is not None:
            ckpt.close()
    return state, history, step_fn


# ---- SFT and DPO ----
def run_sft(model, episodes: Sequence[Episode], *, train_cfg: TrainConfig, optim_cfg: OptimConfig,
            traj_cfg: TrajectoryConfig, num_steps: int, batch_size: int, group_by_length: int = 0, **kw):
    """SFT: masked NLL on the assistant tokens (loss_mask == 1) of `episodes`.

    Every episode must have at least one loss token. `group_by_length=k` batches episodes of
    similar lengths (mega-batches of k batches, `DataIterator`): less padding, the same
    episodes per epoch. Keyword args as `train_offline`.
    """
    empty = [i for i, ep in enumerate(episodes) if not any(ep.loss_mask)]
    if empty:
        raise ValueError(f"episodes {empty[:5]} have no assistant (loss_mask == 1) tokens to train on")
    def to_batch(eps, k):
        return collate(eps, replace(traj_cfg, batch_multiple=math.lcm(traj_cfg.batch_multiple, k)))[0]

    return train_offline(model, episodes, to_batch, "sft", train_cfg=train_cfg, optim_cfg=optim_cfg,
                         num_steps=num_steps, batch_size=batch_size, lengths=[len(ep) for ep in episodes],
                         group_by_length=group_by_length, **kw)


def run_dpo(model, pairs: Sequence[tuple[Episode, Episode]], *, train_cfg: TrainConfig, optim_cfg: OptimConfig,
            traj_cfg: TrajectoryConfig, num_steps: int, batch_size: int, **kw):
    """DPO on (chosen, rejected) episode pairs; `batch_size` counts pairs.

    The reference policy is the frozen initial model (or the LoRA base): `use_ref` is forced
    on. Mini-batch shuffling would separate rows 2i / 2i+1, so it is turned off.
    """
    bad = [i for i, (c, r) in enumerate(pairs) if not any(c.loss_mask) or not any(r.loss_mask)]
    if bad:
        raise ValueError(f"pairs {bad[:5]} have a side without response (loss_mask == 1) tokens")
    train_cfg = replace(train_cfg, use_ref=True, shuffle=False)
    given = kw.get("train_step")
    if given is not None and not (given.cfg.use_ref and (not given.cfg.shuffle or given.cfg.num_mini_batches == 1)):
        raise ValueError("run_dpo needs a train_step built with use_ref=True and no mini-batch shuffling")
    def to_batch(ps, k):  # rows: an even multiple of the data-parallel devices
        return preference_pairs(ps, replace(traj_cfg, batch_multiple=math.lcm(traj_cfg.batch_multiple, k, 2)))

    return train_offline(model, pairs, to_batch, "dpo", train_cfg=train_cfg,
                         optim_cfg=optim_cfg, num_steps=num_steps, batch_size=batch_size, **kw)
