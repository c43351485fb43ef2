"""DEVICE: what a loss reads from one forward pass: `PolicyOutputs` of a batch of rows.

    TrainBatch rows [B, T] --CausalLM.hidden_states (rows whole, continuing shared prefixes,
        or packed several to a row and read back per row)--> hidden [B, T, D]
      --logprobs.token_logprobs_and_entropy / value head--> PolicyOutputs(logp, entropy, values) [B, T]

The train step's only forward (`train/step.py`); the model itself is `decoder.CausalLM`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.model.logprobs import token_logprobs_and_entropy
from jaxrl_agent.structs import PolicyOutputs


def policy_outputs(
    model: CausalLM, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array, *, chunk_size: int = 64,
    loss_mask: jax.Array | None = None, prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    packed: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
) -> PolicyOutputs:
    """Everything a loss needs from one forward pass of `model` over a padded batch.

    Args: tokens, positions int32 `[B, T]`; attention_mask `[B, T]` (1 on real tokens);
      loss_mask `[B, T]` optional: the positions the loss reads; logp / entropy are computed
      only in chunks that hold one (0 elsewhere, `token_logprobs_and_entropy(mask=)`);
      prefix: optional shared prefixes the rows continue (`CausalLM.hidden_states`; the
      outputs cover the rows' own tokens, so position 0 of a row is read as at t = 0);
      packed: optional (pack_tokens, pack_positions, pack_segments `[Pk, Tk]`, pack_slot
      `[B, T]`), as in `TrainBatch`: the model runs on the packed rows instead (one episode
      per segment) and row b's output at t is read from flat packed position
      `pack_slot[b, t]`. A segment's first position would read the segment before it, so
      each row's t = 0 and its padding are set to 0, as for a row run alone.
    Returns:
      `PolicyOutputs(logp, entropy, values)`, float32 `[B, T]` each, aligned with `tokens`:
      `logp[:, t]` / `entropy[:, t]` as in `token_logprobs_and_entropy` (0 at t = 0), and
      `values[:, t]` = V(tokens[:, :t]), the critic's value of the state in which `tokens[:, t]`
      was chosen (read from position t - 1; 0 at t = 0). `values` is None without a value head.
    """
    if packed is not None:
        return _packed_outputs(model, packed, attention_mask, chunk_size, loss_mask, prefix)
    hidden = model.hidden_states(tokens, positions, attention_mask, prefix)
    logp, entropy = token_logprobs_and_entropy(hidden, model.unembedding(), tokens, chunk_size=chunk_size,
                                               mask=loss_mask)
    values = None
    if model.config.value_head:
        v = model.values_from_hidden(hidden)
        values = jnp.concatenate([jnp.zeros((v.shape[0], 1), jnp.float32), v[:, :-1]], axis=1)
    return PolicyOutputs(logp=logp, entropy=entropy, values=values)


def _packed_outputs(model: CausalLM, packed, attention_mask: jax.Array, chunk_size: int,
                    loss_mask: jax.Array | None, prefix) -> PolicyOutputs:
    """`policy_outputs` of rows the model runs packed (its `packed=` argument)."""
    if prefix is not None:
        raise ValueError("a batch is either packed or has shared prefixes, not both "
                         "(TrajectoryConfig.pack_forward with share_prefix_min=0)")
    tokens, positions, segments, slot = packed
    t = slot.shape[1]
    if tokens.ndim != 2 or positions.shape != tokens.shape or segments.shape != tokens.shape or \
            attention_mask.shape != slot.shape:
        raise ValueError(f"pack_tokens {tokens.shape}, pack_positions {positions.shape}, pack_segments "
                         f"{segments.shape} must be [Pk, Tk] and pack_slot {slot.shape} [B, T] like the rows' "
                         f"attention_mask {attention_mask.shape}")
    size = tokens.size  # slot == size: padding, read from the zero appended below
    if loss_mask is not None:  # the loss positions in the packed layout, for the chunk skip
        loss_mask = jnp.zeros((size + 1,), jnp.int32).at[slot.reshape(-1)].max(
            (loss_mask > 0).astype(jnp.int32).reshape(-1))[:size].reshape(tokens.shape)
    out = policy_outputs(model, tokens, positions, segments, chunk_size=chunk_size, loss_mask=loss_mask)
    own = (attention_mask > 0) & (jnp.arange(t) > 0)[None, :]

    def rows(x: jax.Array) -> jax.Array:
        flat = jnp.concatenate([x.reshape(-1), jnp.zeros((1,), x.dtype)])
        return jnp.where(own, flat[slot], 0.0)

    return PolicyOutputs(logp=rows(out.logp), entropy=rows(out.entropy),
                         values=None if out.values is None else rows(out.values))
