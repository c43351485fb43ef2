"""DEVICE: the policy network (layer 4 of ARCHITECTURE.md; `jaxrl_agent.hf` beside it).

    layers.py    RMSNorm, RoPE, GQA attention, dense: pure functions
    kv_cache.py  the fixed-size KV cache of the cached decoding path
    logprobs.py  per-token log-probs and entropies, chunked over the sequence
    decoder.py   `CausalLM` (Llama-3 / Qwen2 / Qwen3, optional value head)
    outputs.py   `policy_outputs`: what a loss reads from a forward (rows, shared prefixes, packed)
"""
