"""DEVICE + HOST: the update (layer 6 of ARCHITECTURE.md).

    step.py         `make_train_step`: the only value_and_grad; epochs, mini- and micro-batches
    sharding.py     the mesh and the one logical-axis rules table
    lora.py         low-rank adapters, base frozen
    checkpoint.py   orbax checkpoints and HF export (the only module importing orbax)
    weight_sync.py  trainer -> sampler: the current policy as the engine's copy
"""
