"""DEVICE-side containers shared by losses, advantages, trajectory and the train step.

Both are pytrees (flax.struct dataclasses), so they pass through `jax.jit` and can be
sharded leaf by leaf. Optional fields are `None` when absent; a different set of present
fields is a different pytree structure and so a different compilation, which is fine because
it is fixed for a run.
"""
from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class TrainBatch:
    """A padded batch of episodes (DESIGN §3). All `[B, T]` unless noted; padding has every
    mask 0 and `turn_id == -1`.

    tokens:        int32 token ids.
    positions:     int32 position of each token in its sequence (packing restarts them).
    attention_mask: 1 on real tokens, 0 on padding.
    loss_mask:     1 on policy-sampled tokens, 0 on prompt / observation / padding tokens.
    sampler_logp:  f32 log-prob the sampler reported for each sampled token (0 elsewhere).
    turn_id:       int32 turn index of each token, -1 on padding.
    token_rewards: f32 scalar episode reward placed on the last policy token of the row.
    group_id:      int32 `[B]` prompt group of each row (GRPO / RLOO groups).
    reward:        f32 `[B]` scalar episode reward.
    ref_logp:      optional f32 log-probs under the frozen reference policy.
    old_logp:      optional f32 log-probs under the policy that collected the data.
    old_values:    optional f32 critic values at collection time.
    advantages:    optional f32 precomputed advantages (a loss computes its own if None).
    returns:       optional f32 value targets computed with `advantages` (GAE's; PPO's value loss).

    Shared prefixes (`TrajectoryConfig.share_prefix_min`; all three present or all None): a
    GRPO group's rows begin with the same prompt, which the model then runs once per group
    instead of once per row. Row b's sequence is the real tokens of
    `prefix_tokens[prefix_index[b]]` followed by the row's own `tokens`; every `[B, T]` field
    covers the row's own part only (`positions` continue from the prefix's length), and a
    prefix never holds a loss token.
    prefix_tokens: optional int32 `[P, Tp]` the shared prefixes, right-padded; P is a multiple
                   of the row multiple, so these leaves shard over the batch devices too.
    prefix_mask:   optional int32 `[P, Tp]`, 1 on a prefix's real tokens.
    prefix_index:  optional int32 `[B]`, the prefix row b continues (one with no real token:
                   none).

    Packed forward (`TrajectoryConfig.pack_forward`; all four present or all None): the rows
    keep one episode each, and the model runs them packed several to a row.
    pack_tokens:   optional int32 `[Pk, Tk]` the rows' real tokens, first-fit into Pk rows
                   (Pk a multiple of the row multiple, as for the prefixes).
    pack_positions: optional int32 `[Pk, Tk]` each packed token's row position.
    pack_segments: optional int32 `[Pk, Tk]` segment ids 1, 2, ... per packed row, 0 on padding.
    pack_slot:     optional int32 `[B, T]` where row b's token t sits in the packed rows,
                   flattened (`p * Tk + offset`); Pk * Tk for padding (no token).
    """

    tokens: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    sampler_logp: jax.Array
    turn_id: jax.Array
    token_rewards: jax.Array
    group_id: jax.Array
    reward: jax.Array
    ref_logp: jax.Array | None = None
    old_logp: jax.Array | None = None
    old_values: jax.Array | None = None
    advantages: jax.Array | None = None
    returns: jax.Array | None = None
    prefix_tokens: jax.Array | None = None
    prefix_mask: jax.Array | None = None
    prefix_index: jax.Array | None = None
    pack_tokens: jax.Array | None = None
    pack_positions: jax.Array | None = None
    pack_segments: jax.Array | None = None
    pack_slot: jax.Array | None = None

    @property
    def prefix(self) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """(prefix_tokens, prefix_mask, prefix_index), the model's `prefix=` argument, or None."""
        return None if self.prefix_tokens is None else (self.prefix_tokens, self.prefix_mask, self.prefix_index)

    @property
    def packed(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None:
        """(pack_tokens, pack_positions, pack_segments, pack_slot), `policy_outputs(packed=)`, or None."""
        if self.pack_tokens is None:
            return None
        return self.pack_tokens, self.pack_positions, self.pack_segments, self.pack_slot


@struct.dataclass
class PolicyOutputs:
    """What the train step computes once per forward pass and hands to a loss.

    logp:    f32 `[B, T]` log-prob of `tokens[:, t]` under the current policy.
    entropy: f32 `[B, T]` entropy of the policy distribution that predicted `tokens[:, t]`.
    values:  optional f32 `[B, T]` critic values (None without a value head).
    """

    logp: jax.Array
    entropy: jax.Array
    values: jax.Array | None = None
