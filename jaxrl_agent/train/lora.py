"""DEVICE: low-rank adapters (LoRA) on the attention and MLP projections, base weights frozen.

    W_eff = W + (alpha / r) * A @ B,    A: [in, r] (normal init),  B: [r, out] (zeros)

Every target weight is stacked over layers (`[L, *in, *out]` in model/decoder.py), so its adapter is
A `[L, *in, r]` and B `[L, r, *out]`. The adapted weight is formed before the forward pass
(one small matmul per weight per step) and handed to the unchanged model, so the sampler,
the trainer and `hf.save_pretrained` (after `merge`) all see one kind of parameter dict. Only
the adapters are trained; the base weights double as the frozen reference policy.

Reference: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models".
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl_agent.config import LoraConfig

# number of input dims after the leading `layers` axis, per target (the rest are outputs)
IN_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def _check(base: dict, cfg: LoraConfig) -> None:
    if cfg.rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {cfg.rank}")
    unknown = [t for t in cfg.targets if t not in IN_DIMS]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; supported: {sorted(IN_DIMS)}")
    missing = [t for t in cfg.targets if t not in base]
    if missing:
        raise ValueError(f"LoRA targets {missing} are not parameters of the model")


def init_lora(base: dict, cfg: LoraConfig, key: jax.Array) -> dict:
    """Adapters {target: {"a": [L, *in, r], "b": [L, r, *out]}} in the base weights' dtype.

    A ~ normal(0, init_std) (default 1 / sqrt(fan_in)), B = 0, so the adapted model equals
    the base model at step 0.
    """
    _check(base, cfg)
    out = {}
    for i, name in enumerate(cfg.targets):
        w = base[name]
        k = IN_DIMS[name]
        ins, outs = w.shape[1:1 + k], w.shape[1 + k:]
        std = cfg.init_std if cfg.init_std is not None else 1.0 / math.sqrt(math.prod(ins))
        a = std * jax.random.normal(jax.random.fold_in(key, i), (w.shape[0], *ins, cfg.rank), jnp.float32)
        out[name] = {"a": a.astype(w.dtype), "b": jnp.zeros((w.shape[0], cfg.rank, *outs), w.dtype)}
    return out


def lora_logical_axes(base_logical: dict, cfg: LoraConfig) -> dict:
    """Logical axes of the adapters from the base weights' (A keeps the input axes, B the
    output axes; the rank axis is "lora")."""
    out = {}
    for name in cfg.targets:
        ax = tuple(base_logical[name])
        k = IN_DIMS[name]
        out[name] = {"a": (ax[0], *ax[1:1 + k], "lora"), "b": (ax[0], "lora", *ax[1 + k:])}
    return out


def delta(a: jax.Array, b: jax.Array, n_in: int) -> jax.Array:
    """A @ B over the flattened input / output dims: `[L, *in, r] x [L, r, *out] -> [L, *in, *out]`."""
    L, r = a.shape[0], a.shape[-1]
    ins, outs = a.shape[1:-1], b.shape[2:]
    if len(ins) != n_in:
        raise ValueError(f"adapter A {a.shape} should have {n_in} input dims")
    d = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1))
    return d.reshape(L, *ins, *outs)


def apply_lora(base: dict, adapters: dict, cfg: LoraConfig) -> dict:
    """Params with `W + (alpha / r) A B` on every adapted weight (others unchanged)."""
    scale = cfg.alpha / cfg.rank
    out = dict(base)
    for name, ab in adapters.items():
        out[name] = base[name] + (scale * delta(ab["a"], ab["b"], IN_DIMS[name])).astype(base[name].dtype)
    return out
