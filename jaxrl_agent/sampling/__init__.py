"""DEVICE + HOST: sampling from the policy (layer 5 of ARCHITECTURE.md).

    decode.py         jitted prefill and decode loop over a KV cache
    engine.py         `SamplingEngine`: episodes in rows, continuous batching, shape buckets
    engine_config.py  the one place an engine's config is derived for episodes and checked
    prefill_plan.py   the prefill calls of one flush, least padded work over the compiled shapes
    prefix_sources.py where a new prompt can copy its leading tokens from instead of prefilling
"""
