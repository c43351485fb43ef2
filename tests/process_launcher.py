"""Launch a worker script as the processes of a `jax.distributed` job on localhost (CPU
collectives), for the multi-process tests; every wait is bounded and no worker outlives it."""
import os
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, args: list[str], *, processes: int = 2, devices_per_process: int = 1,
           timeout_s: float = 300) -> list[tuple[int, str]]:
    """Run `python script *args` `processes` times, joined through JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID, each with `devices_per_process` CPU devices; returns
    (exit code, output) per process."""
    port = free_port()
    root = os.path.dirname(TESTS)
    procs = []
    for pid in range(processes):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                   JAX_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
                   PYTHONPATH=os.pathsep.join([root, TESTS, env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            results.append((p.returncode, out))
    finally:
        for p in procs:  # never leave a worker behind (a timeout or a failed sibling)
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results
