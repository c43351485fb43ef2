"""Multi-process test: two processes on localhost joined by `jax.distributed` (CPU collectives,
2 devices each, an fsdp mesh over all 4) compute the same train steps as one process on one
device. The worker is tests/trainer_worker.py; every wait is bounded by a timeout."""
import os

import jax
import numpy as np
import pytest

import trainer_worker as tw
from jaxrl_agent.config import MeshConfig, TrajectoryConfig
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.train import sharding as sh
from jaxrl_agent.train.step import make_train_step
from jaxrl_agent.trajectory import collate
from process_launcher import launch

WORKER = os.path.join(os.path.dirname(__file__), "trainer_worker.py")
TIMEOUT_S = 300


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    out_path = str(tmp_path / "dist.npz")
    results = launch(WORKER, [out_path], devices_per_process=2, timeout_s=TIMEOUT_S)
    for rc, log in results:
        assert rc == 0, log[-3000:]
    got = np.load(out_path)
    assert int(got["processes"]) == 2 and int(got["devices"]) == 4

    # ---- the same run in this process, on one device ----
    mesh_cfg = MeshConfig(data=1)
    cfg = tw.distributed_train_config(mesh_cfg)
    model = tw.tiny_model()
    ts = make_train_step(LOSSES["grpo"], tw.distributed_optimizer(), cfg, model,
                         mesh=sh.make_mesh(mesh_cfg, jax.devices()[:1]))
    state = ts.init_state(model, seed=0)
    batch, _ = collate(tw.random_episodes(8, seed=3), TrajectoryConfig(buckets=(32,), batch_multiple=4))
    losses = []
    for _ in range(tw.STEPS):
        state, m = ts(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(got["loss"], losses, atol=1e-6)
    params = jax.device_get(ts.policy_params(state))
    assert float(np.abs(params["wq"] - np.asarray(model.wq[...])).max()) > 1e-3  # the steps moved the params
    for k, v in params.items():
        np.testing.assert_allclose(got[k], v, atol=1e-5, rtol=1e-4, err_msg=k)
