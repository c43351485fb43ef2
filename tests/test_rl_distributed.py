"""The RL loop on two processes joined by `jax.distributed` on localhost (CPU collectives, one
device each) against one process on the same tasks: each process rolls out half of the
episodes, and the two give the same update, also across a resume. The worker is
tests/rl_worker.py; every wait is bounded by a timeout."""
import glob
import json
import os

import numpy as np
import pytest

import rl_worker
from jaxrl_agent import hf
from jaxrl_agent.tokenizer import load_tokenizer
from process_launcher import launch

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "rl_worker.py")
TIMEOUT_S = 600


def test_two_processes_split_the_rollouts_and_match_one_process(tmp_path):
    tok = load_tokenizer()
    model = rl_worker.sft_policy(tok)
    policy = str(tmp_path / "policy")
    hf.save_pretrained(model, model.config, policy, tokenizer=tok)
    # one process, in this process (8 simulated devices), from the same saved policy
    from jaxrl_agent.agent.policy import load_policy

    ref_iters, ref = rl_worker.run_two_iterations(load_policy(policy)[0], tok, str(tmp_path / "one"))
    ref_params = ref["train_step"].host_policy_params(ref["state"])
    out = str(tmp_path / "two")
    for rc, log in launch(WORKER, [policy, str(tmp_path / "run2"), out], timeout_s=TIMEOUT_S):
        assert rc == 0, log[-4000:]
    got = [json.load(open(f"{out}.{p}.json")) for p in range(2)]
    params = dict(np.load(out + ".npz"))
    # every collect_episodes call of a process ran half of the episodes one process runs
    for g in got:
        assert g["processes"] == 2
        # iteration 1 (the probe) 2 tasks x 8, repeat 1, eval 2 x 4, eval after 2 x 4 (first run);
        # iteration 2: 2 x 8, eval after 2 x 4 (the resumed run)
        assert g["local_episodes"] == [8, 1, 4, 4, 8, 4], g["local_episodes"]
    # the logged metrics are the whole batch's and equal one process's
    for a, b in zip(got[0]["iterations"], ref_iters):
        for key in ("rollout/reward_mean", "rollout/success", "rollout/mixed_group_share", "train/policy_tokens"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    assert got[0]["after"]["n_episodes"] == ref["after"]["n_episodes"] == 8
    assert got[0]["after"]["pass1"] == pytest.approx(ref["after"]["pass1"])
    for a, b in zip(got[1]["iterations"], got[0]["iterations"]):  # every process sees the same global values
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")}
    # the same update, after a resume, within float tolerance
    assert set(params) == set(ref_params)
    for k, v in ref_params.items():
        np.testing.assert_allclose(params[k], v, atol=2e-5, rtol=1e-4, err_msg=k)
    assert all(it["train/update_norm"] > 1e-3 for it in ref_iters)  # the updates were not empty
    assert len(glob.glob(str(tmp_path / "run2" / "checkpoints" / "*"))) >= 2
    assert os.path.exists(tmp_path / "run2" / "metrics.jsonl") and os.path.exists(tmp_path / "run2" / "policy")
