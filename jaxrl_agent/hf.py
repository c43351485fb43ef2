"""HOST: Hugging Face checkpoint directories <-> `model.CausalLM` (DESIGN §5, §11).

A checkpoint directory is what `transformers` writes: `config.json` plus either
`model.safetensors` or sharded `*.safetensors` files listed by `model.safetensors.index.json`.
Supported architectures: `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`. Reading
needs neither torch nor transformers (config.json is parsed directly, tensors are read with
safetensors into NumPy); the written directory loads with `AutoModelForCausalLM.from_pretrained`.

Layout changes between the two worlds (HF Linear weights are `[out, in]`):
    q_proj.weight [H*Dh, D]  <->  wq [L, D, H, Dh]        (per layer: W.T reshaped)
    o_proj.weight [D, H*Dh]  <->  wo [L, H, Dh, D]
    gate/up_proj  [F, D]     <->  w_gate / w_up [L, D, F]
    down_proj     [D, F]     <->  w_down [L, F, D]
A value head is not an HF tensor; it is saved to / read from `value_head.safetensors`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_agent.model.decoder import CausalLM, ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
VALUE_HEAD_FILE = "value_head.safetensors"
# Buffers some older exports contain; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---- config.json <-> ModelConfig ---------------------------------------------------------


def config_from_hf(hf: dict, *, source: str = "config.json", value_head: bool = False) -> ModelConfig:
    """Map a parsed HF `config.json` dict to a `ModelConfig`; unsupported variants raise."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
    heads = hf["num_attention_heads"]
    # transformers >= 5 nests RoPE settings in rope_parameters; older files use rope_theta/rope_scaling.
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{source}: unsupported rope type {rope_type!r} (supported: default, llama3)")
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 8.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        value_head=value_head,
        architecture=arch,
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )


def config_to_hf(cfg: ModelConfig, dtype_name: str = "float32") -> dict:
    """A `config.json` dict for `cfg`; raises if the architecture cannot express `cfg`."""
    arch = cfg.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"cannot export architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch == "Qwen2ForCausalLM" and (not cfg.qkv_bias or cfg.o_bias or cfg.qk_norm):
        raise ValueError("Qwen2ForCausalLM needs qkv_bias=True, o_bias=False, qk_norm=False")
    if arch != "Qwen2ForCausalLM" and cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{arch} has one attention_bias flag: qkv_bias and o_bias must be equal")
    if (arch == "Qwen3ForCausalLM") != cfg.qk_norm:
        raise ValueError(f"qk_norm={cfg.qk_norm} is only expressible as Qwen3ForCausalLM, not {arch}")
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    out = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope,
        # Older transformers read these two keys instead of rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope if cfg.rope_type != "default" else None,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }
    if arch != "Qwen2ForCausalLM":
        out["attention_bias"] = cfg.qkv_bias
    if arch != "LlamaForCausalLM":
        out["use_sliding_window"] = False
    return out


# ---- tensor name / layout table ----------------------------------------------------------

_T = lambda w: np.swapaxes(w, -1, -2)  # noqa: E731


def _tensor_table(cfg: ModelConfig) -> list[tuple[str, str, tuple, Callable, Callable]]:
    """(our name, HF name with {i} for the layer, HF shape, hf->ours, ours->hf) per tensor."""
    d, f, h, k, dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = (lambda w: w, lambda w: w)
    proj_in = lambda n: (lambda w: _T(w).reshape(d, n, dh), lambda w: _T(w.reshape(d, n * dh)))  # noqa: E731
    attn = "model.layers.{i}.self_attn."
    mlp = "model.layers.{i}.mlp."
    rows = [
        ("embed", "model.embed_tokens.weight", (cfg.vocab_size, d), *ident),
        ("final_norm", "model.norm.weight", (d,), *ident),
        ("attn_norm", "model.layers.{i}.input_layernorm.weight", (d,), *ident),
        ("mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", (d,), *ident),
        ("wq", attn + "q_proj.weight", (h * dh, d), *proj_in(h)),
        ("wk", attn + "k_proj.weight", (k * dh, d), *proj_in(k)),
        ("wv", attn + "v_proj.weight", (k * dh, d), *proj_in(k)),
        ("wo", attn + "o_proj.weight", (d, h * dh), lambda w: _T(w).reshape(h, dh, d), lambda w: _T(w.reshape(h * dh, d))),
        ("w_gate", mlp + "gate_proj.weight", (f, d), _T, _T),
        ("w_up", mlp + "up_proj.weight", (f, d), _T, _T),
        ("w_down", mlp + "down_proj.weight", (d, f), _T, _T),
    ]
    if not cfg.tie_word_embeddings:
        rows.append(("lm_head", "lm_head.weight", (cfg.vocab_size, d), *ident))
    if cfg.qkv_bias:
        for name, proj, n in (("bq", "q_proj", h), ("bk", "k_proj", k), ("bv", "v_proj", k)):
            rows.append((name, attn + proj + ".bias", (n * dh,), lambda w, n=n: w.reshape(n, dh), lambda w, n=n: w.reshape(n * dh)))
    if cfg.o_bias:
        rows.append(("bo", attn + "o_proj.bias", (d,), *ident))
    if cfg.qk_norm:
        rows.append(("q_norm", attn + "q_norm.weight", (dh,), *ident))
        rows.append(("k_norm", attn + "k_norm.weight", (dh,), *ident))
    return rows


# ---- safetensors io ----------------------------------------------------------------------


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, from the index or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        for fname in sorted(set(files.values())):
            if not os.path.exists(fname):
                raise FileNotFoundError(f"{index} lists {os.path.basename(fname)}, which is missing from {path}")
        return files
    if os.path.exists(single):
        with safe_open(single, framework="numpy") as fh:
            return {name: single for name in fh.keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _read_params(config: ModelConfig, path: str, files: dict, handles: dict, table: list) -> dict[str, np.ndarray]:
    """Our parameter name -> array (file dtype), checking names and shapes against config."""

    def read(name: str, shape: tuple) -> np.ndarray:
        if name not in files:
            raise ValueError(f"missing tensor {name!r} in {path} (architecture {config.architecture})")
        arr = handles[files[name]].get_tensor(name)
        if arr.shape != shape:
            raise ValueError(f"tensor {name!r} in {files[name]} has shape {arr.shape}, config.json implies {shape}")
        return arr  # kept in the file dtype; cast once, on device, to `dtype`

    expected = set()
    params = {}
    for ours, hf_name, shape, to_ours, _ in table:
        if "{i}" in hf_name:
            names = [hf_name.format(i=i) for i in range(config.num_layers)]
            params[ours] = np.stack([to_ours(read(n, shape)) for n in names])
        else:
            names = [hf_name]
            params[ours] = to_ours(read(hf_name, shape))
        expected.update(names)
    unexpected = sorted(
        n for n in files
        if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and config.tie_word_embeddings)  # some tied exports keep a copy
    )
    if unexpected:
        raise ValueError(f"unexpected tensors in {path} for {config.architecture}: {unexpected[:8]}")
    return params


def load_pretrained(path: str, dtype=jnp.float32, *, value_head: bool = False) -> tuple[CausalLM, ModelConfig]:
    """Load a local HF checkpoint directory into a `CausalLM`.

    Args:
      path: directory with config.json and safetensors weights (single or sharded).
      dtype: parameter dtype (jnp.float32 or jnp.bfloat16); tensors are cast on load.
      value_head: add a value head, read from `value_head.safetensors` when present, else
        zero-initialised.
    Returns:
      (model, config).
    Raises:
      FileNotFoundError naming a missing file; ValueError naming an unsupported architecture,
      a missing or unexpected tensor, or a tensor whose shape does not match config.json.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"missing {cfg_path}")
    with open(cfg_path) as fh:
        config = config_from_hf(json.load(fh), source=cfg_path, value_head=value_head)
    files = _weight_files(path)
    table = _tensor_table(config)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="numpy")) for f in sorted(set(files.values()))}
        params = _read_params(config, path, files, handles, table)
    if value_head:
        vh_path = os.path.join(path, VALUE_HEAD_FILE)
        if os.path.exists(vh_path):
            with safe_open(vh_path, framework="numpy") as fh:
                for name, shape in (("value_w", (config.hidden_size,)), ("value_b", ())):
                    arr = fh.get_tensor(name)
                    if arr.shape != shape:
                        raise ValueError(f"tensor {name!r} in {vh_path} has shape {arr.shape}, expected {shape}")
                    params[name] = arr

    # Build the module without spending time on random init, then fill every parameter.
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), dtype=dtype))
    for (name,), var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = params.get(name)
        if value is None:  # only the value head may be absent from the files
            value = np.zeros(var.shape, np.float32)
        getattr(model, name).set_value(jnp.asarray(value, dtype=dtype))
    return model, config


def save_pretrained(model: CausalLM, config: ModelConfig, path: str, tokenizer=None) -> None:
    """Write `model` as an HF checkpoint directory that `transformers` loads.

    Writes config.json, model.safetensors (tensors in the parameter dtype) and, with a value
    head, value_head.safetensors; with `tokenizer` (a `tokenizer.Tokenizer` or a
    `transformers` tokenizer) also its files, so the directory is a complete policy that
    `pipelines.load_policy` and `AutoTokenizer` read back. The directory is created if needed.
    """
    if dataclasses.replace(model.config, remat=config.remat) != config:
        raise ValueError("config does not describe model (model.config differs)")
    hf_tokenizer = getattr(tokenizer, "hf", tokenizer)  # our wrapper or a transformers tokenizer
    if hf_tokenizer is not None and len(hf_tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(hf_tokenizer)} ids but the model has only "
                         f"vocab_size={config.vocab_size} embedding rows: they do not belong together")
    os.makedirs(path, exist_ok=True)
    dtype_name = str(np.asarray(model.embed[...]).dtype)
    tensors = {}
    for ours, hf_name, _, _, to_hf in _tensor_table(config):
        value = np.asarray(getattr(model, ours)[...])
        if "{i}" in hf_name:
            for i in range(config.num_layers):
                tensors[hf_name.format(i=i)] = np.ascontiguousarray(to_hf(value[i]))
        else:
            tensors[hf_name] = np.ascontiguousarray(to_hf(value))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config_to_hf(config, dtype_name), fh, indent=2)
    if config.value_head:
        save_file(
            {"value_w": np.asarray(model.value_w[...]), "value_b": np.asarray(model.value_b[...])},
            os.path.join(path, VALUE_HEAD_FILE),
        )
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(path)
