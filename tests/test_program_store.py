"""The program store (jaxrl_agent/program_store.py): a program loaded from disk computes what the
plain jit computes, a change to anything the trace reads loads no stale program, and a store it
cannot use falls back to the plain jit."""
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import program_store as ps


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in a fresh directory (outside tests: beside JAX's persistent cache)."""
    monkeypatch.setattr(ps, "DIRECTORY", str(tmp_path / "programs"))
    return tmp_path / "programs"


@dataclass(frozen=True)
class Cfg:
    scale: float
    mode: str = "a"


TRACES = []


def make(cfg: Cfg):
    """A function closing over `cfg`, the way the train step closes over its config."""
    def f(x, y):
        TRACES.append(cfg)
        out = {"z": x * cfg.scale + y.sum(), "n": jnp.int32(x.shape[0])}
        return out if cfg.mode == "a" else {**out, "z": -out["z"]}
    return ps.StoredJit(f, "f", cfg)


def test_a_loaded_program_equals_the_jit_and_skips_tracing(store):
    x, y = jnp.arange(4.0), np.ones((2, 3), np.float32)
    first = make(Cfg(2.0))
    assert first.enabled()
    want = first.jitted(x, y)
    np.testing.assert_array_equal(first(x, y)["z"], want["z"])
    files = sorted(os.listdir(store))
    assert len(files) == 1 and files[0].startswith("f-")
    # a fresh StoredJit (a new process's) loads the file: its function is never traced
    again, TRACES[:] = make(Cfg(2.0)), []
    out = again(x, y)
    assert TRACES == [] and sorted(os.listdir(store)) == files
    np.testing.assert_array_equal(out["z"], want["z"])
    assert int(out["n"]) == 4
    # a new shape is a new program
    again(jnp.arange(5.0), y)
    assert len(os.listdir(store)) == 2


def test_what_the_trace_reads_is_in_the_key(store):
    x, y = jnp.arange(4.0), np.ones((2, 3), np.float32)
    outs = {c: make(c)(x, y)["z"] for c in (Cfg(2.0), Cfg(3.0), Cfg(2.0, "b"))}
    np.testing.assert_array_equal(outs[Cfg(3.0)], x * 3 + 6)
    np.testing.assert_array_equal(outs[Cfg(2.0, "b")], -(x * 2 + 6))
    assert len(os.listdir(store)) == 3
    # a float32 argument where an int32 one was: its own program
    np.testing.assert_array_equal(make(Cfg(2.0))(jnp.arange(4), y)["z"], jnp.arange(4) * 2.0 + 6)


def test_jax_settings_a_trace_reads_are_in_the_key(store):
    """A program traced under another matmul precision or promotion rule is another program, on
    disk and in memory (as jit retraces)."""
    x, y = jnp.arange(4.0), np.ones((2, 3), np.float32)
    f = make(Cfg(2.0))
    f(x, y)
    with jax.default_matmul_precision("bfloat16"):
        f(x, y)
    with jax.numpy_dtype_promotion("strict"):
        make(Cfg(2.0))(x, y)
    assert len(os.listdir(store)) == 3 and len(f._programs) == 2


def test_donated_arguments_stay_donated(store):
    f = ps.StoredJit(lambda a, b: (a + b, b * 2), "donate", "v1", donate_argnums=0)
    a, b = jnp.ones(8), jnp.ones(8)
    s, _ = f(a, b)
    assert a.is_deleted() and not b.is_deleted()
    np.testing.assert_array_equal(s, 2.0)


def test_program_compiles_from_shapes_for_a_background_thread(store):
    f = make(Cfg(2.0))
    run = f.program(jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32))
    assert f.program(jnp.arange(4.0), np.ones((2, 3), np.float32)) is run  # the same shapes: the same program
    np.testing.assert_array_equal(run(jnp.arange(4.0), np.ones((2, 3), np.float32))["z"], jnp.arange(4.0) * 2 + 6)


def test_a_damaged_file_is_rebuilt(store):
    x, y = jnp.arange(4.0), np.ones((2, 3), np.float32)
    make(Cfg(2.0))(x, y)
    (path,) = store.iterdir()
    path.write_bytes(b"not a program")
    np.testing.assert_array_equal(make(Cfg(2.0))(x, y)["z"], x * 2 + 6)
    assert path.read_bytes() != b"not a program"


def test_the_least_recently_used_programs_go_past_the_size_bound(store, monkeypatch):
    y = np.ones((2, 3), np.float32)
    f = make(Cfg(2.0))
    f(jnp.arange(1.0), y)
    (first,) = store.iterdir()
    monkeypatch.setattr(ps, "MAX_BYTES", 2 * first.stat().st_size + 64)
    os.utime(first, (1, 1))  # long unused
    f(jnp.arange(2.0), y)
    make(Cfg(2.0))(jnp.arange(1.0), y)  # a new process reads the first: it is recent again
    f(jnp.arange(3.0), y)  # a third program: the bound keeps two
    names = {p.name for p in store.iterdir()}
    assert len(names) == 2 and first.name in names


def test_off_without_a_persistent_cache_and_for_what_it_cannot_describe(store, monkeypatch):
    class Opaque:
        pass

    with pytest.raises(ps.Unfingerprintable):
        ps.fingerprint(Opaque())
    f = ps.StoredJit(lambda x: x + 1, "opaque", Opaque())
    assert not f.enabled()
    np.testing.assert_array_equal(f(jnp.zeros(2)), 1.0)
    monkeypatch.setattr(ps, "DIRECTORY", None)
    assert jax.config.jax_compilation_cache_dir is None and not make(Cfg(2.0)).enabled()
    assert not store.exists()


def test_fingerprint_sees_code_closures_and_globals():
    def closure(k):
        return lambda x: x * k

    assert ps.fingerprint(closure(2)) != ps.fingerprint(closure(3))
    assert ps.fingerprint(closure(2)) == ps.fingerprint(closure(2))
    assert ps.fingerprint(lambda x: x + 1) != ps.fingerprint(lambda x: x + 2)
    global _SCALE
    _SCALE = 2.0

    def uses_global(x):
        return x * _SCALE

    before = ps.fingerprint(uses_global)
    _SCALE = 3.0
    assert ps.fingerprint(uses_global) != before
    assert ps.fingerprint(np.ones(3)) != ps.fingerprint(np.zeros(3))


_SCALE = 1.0


def test_a_second_process_loads_the_train_step(tmp_path):
    """The train step's program written by one process is loaded by the next without tracing
    the step, and computes what the plain jit computes."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import jax, numpy as np
        import trainer_worker as tw
        from jaxrl_agent import program_store
        from jaxrl_agent.config import LossConfig, MeshConfig, OptimConfig, TrainConfig, TrajectoryConfig
        from jaxrl_agent.losses.registry import LOSSES
        from jaxrl_agent.train import sharding as sh
        from jaxrl_agent.train.step import TrainStep, make_optimizer, make_train_step
        from jaxrl_agent.trajectory import collate
        program_store.DIRECTORY = {str(tmp_path)!r}
        traced, step = [], TrainStep._step
        TrainStep._step = lambda self, *a: traced.append(1) or step(self, *a)
        model = tw.tiny_model()
        cfg = TrainConfig(compiler_options=tw.FAST, loss=LossConfig(kl_coef=0.1), use_ref=True,
                          mesh=MeshConfig(data=1), num_mini_batches=2, advantage="grpo")
        ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=1e-2)), cfg, model,
                             mesh=sh.make_mesh(cfg.mesh, jax.devices()[:1]))
        batch = collate(tw.random_episodes(8, seed=5), TrajectoryConfig(buckets=(32,)))[0]
        state, metrics = ts(ts.init_state(model, seed=2), batch)
        n = len(traced)
        plain_state, plain = ts.step(ts.init_state(model, seed=2), sh.shard_batch(batch, ts.mesh))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain_state.params)))
        print(json.dumps({{"traced": n, "loss": float(metrics["loss"]), "plain_loss": float(plain["loss"]),
                          "same_params": same}}))
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    out = [json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else pytest.fail(r.stderr[-3000:])
           for r in runs]
    assert out[0]["traced"] == 1 and out[1]["traced"] == 0
    for o in out:
        assert o["loss"] == o["plain_loss"] and o["same_params"]
    assert len(list(tmp_path.iterdir())) == 1
