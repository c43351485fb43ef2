"""HOST: device mesh, the logical-axis rules table, parameter / batch sharding, multi-host init.

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`,
`layers`, plus `lora` for adapter ranks); this module alone maps them to the mesh axes
("data", "fsdp", "tensor") through one rules table with three presets:

  dp       every parameter replicated; the batch split over data (and fsdp) devices.
  fsdp     ZeRO-3 style: the `embed` dimension of every weight split over "fsdp", and
           `vocab` too so the embedding tables are never whole on one device.
  fsdp+tp  as fsdp, plus heads / kv_heads / mlp / vocab split over "tensor" (Megatron
           column / row layout; XLA inserts the collectives).

Batches are split over ("data", "fsdp") on their leading dim and replicated over "tensor".
A dimension that the mesh axis does not divide is left unsplit (small heads counts on big
meshes), and `check_replication` fails when that leaves more than a set fraction of the
parameter bytes replicated under an fsdp preset.

Multi-host: `initialize_distributed()` calls `jax.distributed.initialize()` when the launcher's
environment names a coordinator (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID) or when SLURM / a TPU pod is detected; on one process it does nothing, so the
same code runs on a laptop and on a pod.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_agent.config import MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
PRESETS = ("dp", "fsdp", "fsdp+tp")

# ---- the rules table: logical axis -> mesh axis, per preset ----
# Order of preference inside a parameter: the first logical dim that maps to a mesh axis gets
# it; a mesh axis is used at most once per parameter.
LOGICAL_RULES: dict[str, dict[str, str | None]] = {
    #             dp     fsdp     fsdp+tp
    "vocab":    {"dp": None, "fsdp": "fsdp", "fsdp+tp": "tensor"},
    "embed":    {"dp": None, "fsdp": "fsdp", "fsdp+tp": "fsdp"},
    "heads":    {"dp": None, "fsdp": None, "fsdp+tp": "tensor"},
    "kv_heads": {"dp": None, "fsdp": None, "fsdp+tp": "tensor"},
    "mlp":      {"dp": None, "fsdp": None, "fsdp+tp": "tensor"},
    "head_dim": {"dp": None, "fsdp": None, "fsdp+tp": None},
    "layers":   {"dp": None, "fsdp": None, "fsdp+tp": None},
    "lora":     {"dp": None, "fsdp": None, "fsdp+tp": None},
}


# ---- multi-host ----
def initialize_distributed(env: dict | None = None) -> bool:
    """Join a multi-process JAX job when the launcher asks for one; returns True if joined.

    Explicit: JAX_COORDINATOR_ADDRESS (host:port), JAX_NUM_PROCESSES, JAX_PROCESS_ID and
    optionally JAX_LOCAL_DEVICE_IDS (comma-separated). Auto-detected: SLURM (SLURM_NTASKS > 1)
    and TPU pods (TPU_WORKER_HOSTNAMES with several hosts), where JAX reads the cluster itself.
    Must run before anything touches the backend. Idempotent.
    """
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return True
    if env.get("JAX_COORDINATOR_ADDRESS"):
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not")
        local = env.get("JAX_LOCAL_DEVICE_IDS")
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
        )
        return True
    slurm = int(env.get("SLURM_NTASKS", "1")) > 1
    tpu_pod = len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    if slurm or tpu_pod:
        jax.distributed.initialize()  # JAX's cluster auto-detection reads the environment
        return True
    return False


# ---- mesh ----
def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A Mesh with axes ("data", "fsdp", "tensor") over all (global) devices.

    `cfg.data == -1` takes what fsdp * tensor leave. Raises ValueError when the sizes do not
    multiply to the device count or the preset is unknown.
    """
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown sharding preset {cfg.preset!r}; expected one of {PRESETS}")
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if cfg.fsdp < 1 or cfg.tensor < 1 or n % (cfg.fsdp * cfg.tensor):
        raise ValueError(f"fsdp={cfg.fsdp} * tensor={cfg.tensor} must divide the {n} devices")
    data = n // (cfg.fsdp * cfg.tensor) if cfg.data == -1 else cfg.data
    if data * cfg.fsdp * cfg.tensor != n:
        raise ValueError(f"mesh data={data} * fsdp={cfg.fsdp} * tensor={cfg.tensor} != {n} devices")
    if cfg.preset == "dp" and cfg.tensor > 1:
        raise ValueError("preset 'dp' replicates parameters; a tensor axis > 1 needs preset 'fsdp+tp'")
    grid = np.asarray(devices, dtype=object).reshape(data, cfg.fsdp, cfg.tensor)
    return Mesh(grid, AXES)


def batch_size_multiple(mesh: Mesh) -> int:
    """Rows of a batch must be a multiple of this (the data * fsdp devices)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


# ---- logical axes -> partition specs ----
def logical_to_spec(axes: tuple, shape: tuple, mesh: Mesh, preset: str) -> P:
    """PartitionSpec for one array with logical `axes` under `preset` (see LOGICAL_RULES)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown sharding preset {preset!r}; expected one of {PRESETS}")
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    used, spec = set(), []
    for name, dim in zip(axes, shape):
        if name is not None and name not in LOGICAL_RULES:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(LOGICAL_RULES)}")
        mesh_axis = None if name is None else LOGICAL_RULES[name][preset]
        if mesh_axis is None or mesh_axis in used or mesh.shape[mesh_axis] == 1 or dim % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return P(*spec)


def param_shardings(logical: dict, shapes: dict, mesh: Mesh, preset: str) -> dict:
    """NamedShardings for a (nested) dict of params, given their logical axes and shapes."""
    return jax.tree.map(lambda ax, x: NamedSharding(mesh, logical_to_spec(tuple(ax), tuple(x.shape), mesh, preset)),
                        logical, shapes, is_leaf=lambda a: isinstance(a, tuple))


def control_flow_may_hold_collectives(mesh: Mesh) -> bool:
    """Whether a program on `mesh` may put a collective inside a `lax.cond` branch.

    False on a CPU mesh of several devices (simulated ones, or one process per host over
    Gloo): XLA:CPU orders a program's collectives only among themselves, not a collective
    inside a conditional's branch against an independent one beside the conditional, so
    devices can reach the two in different orders and wait for each other forever (seen as an
    all-reduce rendezvous timeout with 8 simulated devices: the log-prob chunk skip's
    `lax.cond` held the unembedding gradient's all-reduce). GPUs and TPUs run each device's
    collectives in program order. tests/test_sharding.py compiles the step on every preset
    and looks for such a conditional.
    """
    return mesh.devices.size == 1 or mesh.devices.flat[0].platform != "cpu"


def shard_params(params: dict, logical: dict, mesh: Mesh, preset: str) -> dict:
    """Place params on the mesh under `preset` (a copy; works for host or device arrays)."""
    return jax.device_put(params, param_shardings(logical, params, mesh, preset))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of every TrainBatch leaf: leading (row) dim over ("data", "fsdp")."""
    return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch, mesh: Mesh):
    """Put a host TrainBatch (NumPy leaves) on the mesh, rows split over data * fsdp devices.

    Multi-process: every process passes the same global batch and keeps the rows of its own
    devices. Raises ValueError when B is not a multiple of data * fsdp.
    """
    k = batch_size_multiple(mesh)
    sharding = batch_sharding(mesh)
    for leaf in jax.tree.leaves(batch):
        if leaf.shape[0] % k:
            raise ValueError(f"batch rows {leaf.shape[0]} must be a multiple of data*fsdp={k} "
                             f"(set TrajectoryConfig.batch_multiple={k})")

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, batch)


def shard_local_batch(batch, mesh: Mesh):
    """Build the global batch from each process's own rows (NumPy leaves, `B / P` rows here).

    Multi-process RL (`loops/multihost.py`): process p passes rows [p B/P, (p+1) B/P) of the global
    batch and never holds the others; on one process this is `shard_batch`. Every process
    must pass the same T and row count. Raises ValueError when the local rows are not a
    multiple of this process's share of data * fsdp devices.
    """
    if jax.process_count() == 1:
        return shard_batch(batch, mesh)
    if getattr(batch, "prefix_tokens", None) is not None:  # its prefix_index is local to this process's rows
        raise ValueError("a batch with shared prefixes cannot be assembled from each process's rows (each "
                         "process's prefix_index counts its own prefixes): collate with "
                         "TrajectoryConfig.share_prefix_min=0 in a multi-process run")
    if getattr(batch, "pack_tokens", None) is not None:  # likewise its pack_slot
        raise ValueError("a batch packed for the model cannot be assembled from each process's rows (each "
                         "process's pack_slot points into its own packed rows): collate with "
                         "TrajectoryConfig.pack_forward=False in a multi-process run")
    k = batch_size_multiple(mesh) // jax.process_count() or 1
    sharding = batch_sharding(mesh)
    for leaf in jax.tree.leaves(batch):
        if leaf.shape[0] % k:
            raise ValueError(f"local batch rows {leaf.shape[0]} must be a multiple of data*fsdp / processes={k}")
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


# ---- the replication check ----
def replicated_fraction(shardings: dict, shapes: dict) -> float:
    """Fraction of parameter bytes that are not split over any mesh axis."""
    total = replicated = 0
    for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)):
        nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        total += nbytes
        if all(a is None for a in s.spec):
            replicated += nbytes
    return replicated / max(total, 1)


def check_replication(shardings: dict, shapes: dict, cfg: MeshConfig) -> float:
    """Under an fsdp preset, raise ValueError when more than `cfg.max_replicated_fraction` of
    the parameter bytes are replicated (a mesh axis that divides nothing, a missing rule).
    Returns the fraction."""
    frac = replicated_fraction(shardings, shapes)
    if cfg.preset != "dp" and cfg.fsdp > 1 and frac > cfg.max_replicated_fraction:
        worst = sorted(((math.prod(x.shape), k) for k, (s, x) in _flat(shardings, shapes) if all(a is None for a in s.spec)),
                       reverse=True)[:5]
        raise ValueError(f"preset {cfg.preset!r} leaves {frac:.1%} of parameter bytes replicated "
                         f"(limit {cfg.max_replicated_fraction:.1%}); largest replicated: {[k for _, k in worst]}")
    return frac


def _flat(shardings: dict, shapes: dict):
    paths = jax.tree_util.tree_flatten_with_path(shardings)[0]
    leaves = jax.tree.leaves(shapes)
    for (path, s), x in zip(paths, leaves):
        yield jax.tree_util.keystr(path), (s, x)
