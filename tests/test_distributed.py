"""Multi-process test: two processes on localhost joined by `jax.distributed` (CPU collectives,
2 devices each, an fsdp mesh over all 4) compute the same train steps as one process on one
device. The worker is tests/trainer_worker.py; every wait is bounded by a timeout."""
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import trainer_worker as tw
from jaxrl_agent import sharding as sh
from jaxrl_agent.config import MeshConfig, TrajectoryConfig
from jaxrl_agent.loss_registry import LOSSES
from jaxrl_agent.train_step import make_train_step
from jaxrl_agent.trajectory import collate

WORKER = os.path.join(os.path.dirname(__file__), "trainer_worker.py")
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out_path: str) -> list[tuple[int, str]]:
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for pid in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
                   JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, WORKER, out_path], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, out))
    finally:
        for p in procs:  # never leave a worker behind (a timeout or a failed sibling)
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    out_path = str(tmp_path / "dist.npz")
    results = _launch(out_path)
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
