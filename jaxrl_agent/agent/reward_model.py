"""HOST + DEVICE: a reward model, the policy's decoder with a scalar head.

    pairs (chosen, rejected) of episodes --pair_batch--> TrainBatch (rows 2i / 2i+1)
      --make_train_step(REWARD_MODEL_LOSSES["bradley_terry"])--> the same jitted, sharded step
      as the policy (only the LossFn differs: it reads `values`, the scalar head)
    -> save_reward_model (HF directory + value_head.safetensors) / load_reward_model
    -> RewardModel: frozen scoring of episodes in batches on device, for the RL loop

The score of an episode is the scalar head read at its **last policy token**, i.e. after the
model has seen the whole episode up to and including the policy's last action. The model is
`model.CausalLM` with `ModelConfig(value_head=True)`: the head (`value_w`, `value_b`) is
exported and loaded exactly like a critic's, so `hf.py` needs nothing new.

Pairs (agent/preference_pairs.py) come from a user's JSONL (`load_preference_pairs`) or from the loop itself
(`pairs_from_groups`: two episodes of one task whose verifier rewards differ).

A `RewardModel` holds a private copy of its parameters and only a forward pass is ever
compiled for it: nothing in the RL loop can update it (tests check the parameters are
bit-identical before and after a policy update).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agent import hf
from jaxrl_agent.agent.preference_pairs import Pair
from jaxrl_agent.config import TrajectoryConfig
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.trajectory import Episode, collate

META_FILE = "reward_model.json"


# ---- the model ----
def with_scalar_head(model: CausalLM) -> CausalLM:
    """A reward model that starts from `model`'s decoder: a copy of every weight plus a scalar
    head (zero-initialised, so every score starts at 0 and the Bradley-Terry loss at log 2).
    A model that already has a head keeps it. The policy's arrays are never shared."""
    cfg = replace(model.config, value_head=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    dtype = params["embed"].dtype
    out = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    for (name,), var in nnx.to_flat_state(nnx.state(out, nnx.Param)):
        value = params.get(name)
        getattr(out, name).set_value(jnp.zeros(var.shape, dtype) if value is None else jnp.array(value, copy=True))
    return out


def save_reward_model(model: CausalLM, path: str, meta: dict | None = None) -> None:
    """Write a reward model as an HF directory (config.json, model.safetensors,
    value_head.safetensors) plus `reward_model.json` (how it scores, training figures)."""
    if not model.config.value_head:
        raise ValueError("not a reward model: the model has no scalar head (use with_scalar_head)")
    hf.save_pretrained(model, model.config, path)
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"kind": "bradley_terry", "score": "scalar head at the last policy token", **(meta or {})}, f,
                  indent=2, default=str)


def load_reward_model(path: str, dtype=jnp.float32) -> CausalLM:
    """Load a directory written by `save_reward_model` (or `rm-train`) as a `CausalLM` with
    its scalar head; a policy directory without a head is refused, not zero-filled."""
    if not os.path.exists(os.path.join(path, hf.VALUE_HEAD_FILE)):
        raise FileNotFoundError(f"{path!r} has no {hf.VALUE_HEAD_FILE}: not a reward model (train one with "
                                "`python -m jaxrl_agent rm-train`)")
    return hf.load_pretrained(path, dtype, value_head=True)[0]


# ---- frozen scoring ----
class RewardModel:
    """Frozen scorer: episodes -> float32 `[N]`, the scalar head at each last policy token.

    Args:
      model: a `CausalLM` with a scalar head; its parameters are copied (the caller's model,
        even the policy itself, can change or be donated without touching the scorer).
      traj: length buckets for the scoring batches (the episodes' longest must fit).
      batch_size: rows per scoring call; every call has this many rows (padding rows are
        added), so the forward compiles once per length bucket.
    """

    def __init__(self, model: CausalLM, traj: TrajectoryConfig = TrajectoryConfig(), batch_size: int = 16):
        if not model.config.value_head:
            raise ValueError("a reward model needs a scalar head (ModelConfig.value_head=True; see with_scalar_head)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config, self.batch_size = model.config, batch_size
        # whole rows: the scorer reads the head at a row's own index (no shared prefixes)
        self.traj = replace(traj, batch_multiple=1, row_buckets=(batch_size,), pack=False, overflow="error",
                            share_prefix_min=0)
        graphdef, state = nnx.split(model)
        self.params = jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # private copy, never donated
        self._score_rows = jax.jit(lambda params, *rows: _score_rows(graphdef, params, *rows))

    def score(self, episodes: Sequence[Episode]) -> np.ndarray:
        """Scores of `episodes` (float32 `[N]`), in order. An episode with no policy token is
        scored at its last token."""
        if not episodes:
            return np.zeros((0,), np.float32)
        top = max(max(e.ids) for e in episodes)
        if top >= self.config.vocab_size:
            raise ValueError(f"token id {top} >= the reward model's vocab size {self.config.vocab_size}: the reward "
                             "model must share the policy's tokenizer")
        order = sorted(range(len(episodes)), key=lambda i: len(episodes[i]))  # similar lengths share a bucket
        out = np.zeros(len(episodes), np.float32)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            bare = [replace(episodes[i], reward=0.0, turn_rewards={}) for i in idx]
            batch, _ = collate(bare, self.traj)
            real = batch.attention_mask > 0
            last = np.where(batch.loss_mask.any(1), _last(batch.loss_mask), _last(real))  # [B]
            scores = self._score_rows(self.params, batch.tokens, batch.positions, batch.attention_mask, last)
            out[idx] = np.asarray(scores)[: len(idx)]
        return out


def _last(mask: np.ndarray) -> np.ndarray:
    """Index of the last nonzero entry of each row of a [B, T] mask (0 for an empty row)."""
    t = mask.shape[1]
    return np.where(mask.any(1), t - 1 - np.argmax(mask[:, ::-1] > 0, axis=1), 0).astype(np.int32)


def _score_rows(graphdef, params, tokens, positions, attention_mask, last):
    """DEVICE: int32 [B, T] rows, last [B] -> f32 [B]: the head on the hidden state at `last`."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(tokens, positions, attention_mask)  # [B, T, D]
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
    return model.values_from_hidden(h)[:, 0]


def pair_accuracy(rm: RewardModel, pairs: Sequence[Pair]) -> dict:
    """Share of pairs the frozen scorer ranks right (a tie counts 1/2) and the mean margin."""
    if not pairs:
        raise ValueError("pair_accuracy needs at least one pair")
    scores = rm.score([e for pair in pairs for e in pair])
    diff = scores[0::2] - scores[1::2]
    return {"accuracy": float(np.mean(np.where(diff > 0, 1.0, np.where(diff == 0, 0.5, 0.0)))),
            "margin": float(diff.mean()), "pairs": len(pairs)}
