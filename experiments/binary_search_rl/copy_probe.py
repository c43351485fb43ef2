"""`python -m experiments.binary_search_rl.copy_probe --task=offset|induction|repeat|keyed [--steps=N]`

Can the study's policy (`TinyModelConfig`: 4 layers, 128 wide) learn the copy an edit needs,
outside the agent format? Four synthetic tasks over random ids (vocabulary 3000, batch 32),
trained from scratch with AdamW (warm-up, cosine decay); loss and accuracy only on the tokens
that must be copied, printed every 100 steps:

    offset     x_1..x_24 SEP x_1..x_24      the copy sits a fixed distance back: one relative
                                            position (RoPE) finds it, no content look-up
    induction  96 ids in which a 12-id segment recurs at a random later offset; scored after
               the recurrence's first id: find the earlier occurrence of the current id and
               copy what followed it (an induction head)
    repeat     a random prefix of 8-48 ids, then that prefix repeated to the end: the copy's
               distance differs from row to row, so content must find it, and half of every row
               is a copy to learn from
    keyed      10 lines `k | x_1..x_6 NL`, then `QUERY k` -> x_1..x_6 of line k: the look-up
               `replace_lines` needs (line number -> that line's text), then induction

A measurement for the README's basic-layer paragraph; nothing in the study reads it.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.binary_search_rl.drills import copy_sequences
from jaxrl_agent.agent.policy import TinyModelConfig
from jaxrl_agent.model.decoder import CausalLM

VOCAB, BATCH = 3000, 32


def offset_batch(rng, n: int = 24):
    x = rng.integers(10, VOCAB, (BATCH, n))
    ids = np.concatenate([x, np.full((BATCH, 1), 5), x], 1)
    mask = np.zeros(ids.shape, np.float32)
    mask[:, n + 2:] = 1  # the copy after its first id, as the other tasks
    return ids, mask


def induction_batch(rng, t: int = 96, s: int = 12):
    ids = rng.integers(10, VOCAB, (BATCH, t))
    mask = np.zeros((BATCH, t), np.float32)
    for b in range(BATCH):
        a = rng.integers(0, t // 2 - s)
        c = rng.integers(a + s, t - s)
        ids[b, c:c + s] = ids[b, a:a + s]
        mask[b, c + 1:c + s] = 1
    return ids, mask


def repeat_batch(rng, t: int = 96):
    """The study's copy stage (`drills.copy_sequences`) over the probe's ids: a random prefix
    of random length (8..t/2) followed by its repeat, so the distance to the copy changes from
    row to row (unlike `offset`) and half of every row is a copy (unlike `induction`)."""
    seqs = copy_sequences(BATCH, range(10, VOCAB), length=t, seed=int(rng.integers(2 ** 31)))
    return np.array([s.ids for s in seqs]), np.array([s.loss_mask for s in seqs], np.float32)


def keyed_batch(rng, lines: int = 10, width: int = 6):
    bar, nl, query = 3, 4, 5
    rows, masks = [], []
    for _ in range(BATCH):
        text = rng.integers(100, VOCAB, (lines, width))
        k = rng.integers(0, lines)
        seq = [tok for i in range(lines) for tok in (10 + i, bar, *text[i], nl)] + [query, 10 + k]
        head = len(seq)
        seq += [*text[k], nl]
        mask = np.zeros(len(seq), np.float32)
        mask[head:head + width] = 1
        rows.append(seq)
        masks.append(mask)
    return np.array(rows), np.array(masks)


TASKS = {"offset": offset_batch, "induction": induction_batch, "repeat": repeat_batch, "keyed": keyed_batch}


def run(task: str, steps: int, lr: float, seed: int = 0, then: tuple[str, ...] = ()) -> list[tuple[int, float, float]]:
    """Train a fresh policy on `task`; returns (step, loss, copy accuracy) every 100 steps.
    `then`: tasks the trained policy is scored on afterwards, without training on them (is
    the copy it learnt a general one?); printed, 8 fresh batches each."""
    make = TASKS[task]
    rng = np.random.default_rng(seed)
    model = CausalLM(TinyModelConfig().build(VOCAB), rngs=nnx.Rngs(seed))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 2), steps, lr / 10)
    opt = nnx.Optimizer(model, optax.adamw(sched), wrt=nnx.Param)
    def loss_fn(m, ids, mask):
        t = ids.shape[1]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), ids.shape)
        logits = m(ids, pos, jnp.ones_like(ids))[:, :-1]  # [B, T-1, V] predicts ids[:, 1:]
        target, w = ids[:, 1:], mask[:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, target)
        return (ce * w).sum() / w.sum(), ((jnp.argmax(logits, -1) == target) * w).sum() / w.sum()

    @nnx.jit
    def step(model, opt, ids, mask):
        (loss, acc), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, ids, mask)
        opt.update(model, grads)
        return loss, acc

    out, t0 = [], time.time()
    for s in range(1, steps + 1):
        ids, mask = make(rng)
        loss, acc = step(model, opt, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
        if s % 100 == 0:
            out.append((s, float(loss), float(acc)))
            print(f"[{task}] step {s} loss {float(loss):.3f} copy accuracy {float(acc):.3f} ({time.time() - t0:.0f}s)",
                  flush=True)
    score = nnx.jit(loss_fn)
    for other in then:
        res = [score(model, *(jnp.asarray(a) for a in TASKS[other](rng))) for _ in range(8)]
        print(f"[{task} -> {other}] untrained on it: loss {np.mean([float(r[0]) for r in res]):.3f} "
              f"copy accuracy {np.mean([float(r[1]) for r in res]):.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.binary_search_rl.copy_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--then", default="", help="comma-separated tasks to score the trained policy on afterwards")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    then = tuple(t for t in args.then.split(",") if t)
    unknown = [t for t in then if t not in TASKS]
    if unknown:
        parser.error(f"--then: unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    run(args.task, args.steps, args.lr, args.seed, then)
    return 0


if __name__ == "__main__":
    sys.exit(main())
