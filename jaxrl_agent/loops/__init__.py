"""HOST: the training loops (layer 8 of ARCHITECTURE.md).

    rl.py            rollouts -> train step -> weight sync -> repeat; evaluation, checkpoints
    rollout_batches.py  how the RL loop collates its rollouts, precompiles, splits rows by process
    offline.py       SFT on episodes, DPO on pairs (and the resumable `DataIterator`)
    reward_model.py  Bradley-Terry training of a reward model
    bandit.py        a tabular tool-choice bandit through the real losses (seconds on CPU)
    multihost.py     the RL loop's work split across the processes of a `jax.distributed` job
    metrics.py       JSONL + TensorBoard metrics, timers, JAX compile time, progress bars
    tensorboard_events.py  TensorBoard's event file (TFRecord of Event protos), no tensorboardX
"""
