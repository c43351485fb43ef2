"""HOST: weight sync, trainer -> sampler, in one place (below every loop that does it).

    TrainState (sharded params or LoRA adapters + frozen base, on the mesh)
      --policy_for_engine: host_policy_params (gathered; LoRA merged) -> to_model-->
    CausalLM on the default device, uncommitted arrays
      --SamplingEngine.update_params--> the sampler's own copy (same shapes: no recompilation)

The RL loop calls the two halves apart (`policy_for_engine` right after the update, a
collective every process joins; `update_params` once the rollout thread has let go of the
engine); everything else calls `sync_engine`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def policy_for_engine(ts, state):
    """The current policy of `TrainStep` `ts` in `state` as an NNX model on the default device
    (the engine's), LoRA merged. The arrays are uncommitted, so the same model can also seed a
    new TrainStep on any mesh."""
    return ts.to_model(jax.tree.map(jnp.asarray, ts.host_policy_params(state)))


def sync_engine(engine, ts, state) -> None:
    """Give `engine` (a `SamplingEngine`) the policy in `state`; the engine recompiles nothing."""
    engine.update_params(policy_for_engine(ts, state))
