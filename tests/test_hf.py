"""Tests for hf.py: logit parity with transformers, export round trip, bf16, sharding, errors."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from jaxrl_agent import hf

V = 89
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, attn_implementation="eager")
CASES = {
    # GQA 4:1, untied, Llama-3.1 rope scaling whose medium band is hit by head_dim 8 at theta 5e5.
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=5e5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=256))),
    # GQA 4:2, tied, q/k/v biases.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    # MHA 2:2, head_dim 24 != D / H, q/k norm, untied, attention biases.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
        rope_theta=1e4, attention_bias=True)),
    # GQA 8:2, tied, no biases.
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, rope_theta=2e5)),
}


def _hf_model(name, seed=0):
    cfg_cls, model_cls, kw = CASES[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**COMMON, **kw)).eval()
    with torch.no_grad():  # move norms and biases off their trivial init so every tensor matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF torch model, checkpoint dir) for every case, written once."""
    out = {}
    for name in CASES:
        model = _hf_model(name)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


def _padded_batch(seed=0):
    """Row 0 full, row 1 right-padded, row 2 left-padded (explicit positions)."""
    rng = np.random.RandomState(seed)
    t = 14
    tokens = rng.randint(0, V, (3, t)).astype(np.int32)
    mask = np.ones((3, t), np.int32)
    mask[1, 9:] = 0
    mask[2, :5] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, positions, mask


def _ours(model, tokens, positions, mask):
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))


@pytest.mark.parametrize("name", list(CASES))
def test_logit_parity_with_transformers(checkpoints, name):
    torch_model, path = checkpoints[name]
    model, config = hf.load_pretrained(path)
    assert config.architecture == type(torch_model).__name__
    tokens, positions, mask = _padded_batch()
    with torch.no_grad():
        ref = torch_model(
            input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions, dtype=torch.long),
        ).logits.numpy()
    ours = _ours(model, tokens, positions, mask)
    real = mask.astype(bool)  # padded query positions are garbage in both implementations
    diff = np.abs(ours - ref)[real].max()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff}"


def _greedy(model, prompt, steps):
    """Our greedy decode: one prefill, then `steps - 1` cached decode steps."""
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda s, tok, c: nnx.merge(graphdef, s).prefill(tok, c))
    decode = jax.jit(lambda s, tok, c: nnx.merge(graphdef, s).decode_step(tok, c))
    cache = model.init_cache(prompt.shape[0], prompt.shape[1] + steps)
    logits, cache = prefill(state, jnp.asarray(prompt), cache)
    out = []
    for _ in range(steps):
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(np.asarray(nxt))
        logits, cache = decode(state, nxt, cache)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_greedy(checkpoints, name, tmp_path):
    """load -> save_pretrained -> transformers.from_pretrained generates our greedy tokens."""
    model, config = hf.load_pretrained(checkpoints[name][1])
    hf.save_pretrained(model, config, str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    prompt = np.random.RandomState(1).randint(0, V, (2, 6)).astype(np.int32)
    steps = 10
    with torch.no_grad():
        gen = reloaded.generate(
            torch.tensor(prompt, dtype=torch.long), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
        ).numpy()[:, prompt.shape[1]:]
    np.testing.assert_array_equal(gen, _greedy(model, prompt, steps))
    # and the exported tensors are exactly the loaded ones
    original, exported = load_file(os.path.join(checkpoints[name][1], "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    original.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    assert sorted(original) == sorted(exported)
    for key in original:
        np.testing.assert_array_equal(original[key], exported[key], err_msg=key)


def test_bfloat16_checkpoint_and_sharded_index(checkpoints, tmp_path):
    torch_model, path = checkpoints["qwen2"]
    tokens, positions, mask = _padded_batch(2)
    f32 = _ours(hf.load_pretrained(path)[0], tokens, positions, mask)

    sharded = str(tmp_path / "sharded")
    torch_model.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    np.testing.assert_allclose(_ours(hf.load_pretrained(sharded)[0], tokens, positions, mask), f32, atol=1e-6)

    bf16_dir = str(tmp_path / "bf16")
    torch_model.to(torch.bfloat16).save_pretrained(bf16_dir)
    torch_model.to(torch.float32)
    model, _ = hf.load_pretrained(bf16_dir, dtype=jnp.bfloat16)
    assert model.wq[...].dtype == jnp.bfloat16
    lo = _ours(model, tokens, positions, mask)
    real = mask.astype(bool)
    assert np.abs(lo - f32)[real].max() < 0.1 * np.abs(f32).max()
    # a bf16 export is a bf16 checkpoint with the same bits
    hf.save_pretrained(model, hf.load_pretrained(bf16_dir)[1], str(tmp_path / "bf16_out"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16_out"))
    assert reloaded.dtype == torch.bfloat16
    q_ref = torch_model.model.layers[1].self_attn.q_proj.weight.to(torch.bfloat16)
    assert torch.equal(reloaded.model.layers[1].self_attn.q_proj.weight, q_ref)


def test_value_head_round_trip(checkpoints, tmp_path):
    model, config = hf.load_pretrained(checkpoints["qwen3"][1], value_head=True)
    assert float(jnp.abs(model.value_w[...]).max()) == 0.0  # fresh critic starts at zero
    model.value_w.set_value(jnp.arange(config.hidden_size, dtype=jnp.float32) / 100)
    model.value_b.set_value(jnp.asarray(0.5, jnp.float32))
    hf.save_pretrained(model, config, str(tmp_path))
    again, _ = hf.load_pretrained(str(tmp_path), value_head=True)
    np.testing.assert_array_equal(again.value_w[...], model.value_w[...])
    assert float(again.value_b[...]) == 0.5


# ---- clear errors ------------------------------------------------------------------------


def _copy(path, dst):
    os.makedirs(dst)
    for f in os.listdir(path):
        with open(os.path.join(path, f), "rb") as src, open(os.path.join(dst, f), "wb") as out:
            out.write(src.read())
    return dst


def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)


def test_errors_name_the_problem(checkpoints, tmp_path):
    path = checkpoints["qwen3"][1]

    bad = _copy(path, str(tmp_path / "arch"))
    _edit_config(bad, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        hf.load_pretrained(bad)

    bad = _copy(path, str(tmp_path / "shape"))
    _edit_config(bad, intermediate_size=50)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.\w+_proj.weight.*shape"):
        hf.load_pretrained(bad)

    bad = _copy(path, str(tmp_path / "missing_tensor"))
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        hf.load_pretrained(bad)

    bad = _copy(path, str(tmp_path / "no_config"))
    os.remove(os.path.join(bad, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load_pretrained(bad)

    bad = _copy(path, str(tmp_path / "no_weights"))
    os.remove(os.path.join(bad, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load_pretrained(bad)

    bad = _copy(path, str(tmp_path / "lost_shard"))
    os.remove(os.path.join(bad, "model.safetensors"))
    with open(os.path.join(bad, "model.safetensors.index.json"), "w") as fh:
        json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}, fh)
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        hf.load_pretrained(bad)

    bad = _copy(path, str(tmp_path / "rope"))
    _edit_config(bad, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        hf.load_pretrained(bad)


def test_config_export_rejects_inexpressible():
    cfg = hf.config_from_hf(json.loads(json.dumps(hf.config_to_hf(hf.config_from_hf(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 2})))))
    assert cfg.head_dim == 2 and cfg.num_kv_heads == 2 and not cfg.qkv_bias
    import dataclasses

    with pytest.raises(ValueError, match="qk_norm"):
        hf.config_to_hf(dataclasses.replace(cfg, qk_norm=True))
    with pytest.raises(ValueError, match="attention_bias"):
        hf.config_to_hf(dataclasses.replace(cfg, qkv_bias=True))
