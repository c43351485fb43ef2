"""HOST: the agent acting in the environment, and what its episodes become (layer 7 of
ARCHITECTURE.md).

    policy.py            which policy acts: `load_policy`, `PolicyConfig`, `DEMO_POLICY_DIR`
    rollout.py           sample -> parse -> tools -> observe -> ... -> verify, B episodes in flight
    rewards.py           reward composition, normalisation, per-turn shaping
    evaluation.py        pass@k, Wilson intervals, behaviour and failure layers, rendering
    demonstrations.py    the scripted expert's transcripts as token episodes (SFT data)
    preference_pairs.py  pairs of episodes: batches and the JSONL form
    reward_model.py      a frozen scorer of episodes (the decoder with a scalar head)
"""
