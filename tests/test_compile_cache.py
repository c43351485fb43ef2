"""The persistent compilation cache (cli/compile_cache.py): where it goes, that `off` turns it off,
and that a second process loads what the first compiled instead of compiling it again."""
import json
import os
import subprocess
import sys

from jaxrl_agent.cli import compile_cache as cc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One jit in a fresh process with the cache at argv[1]; prints the cache events it saw.
_CHILD = """
import json, sys
import jax, jax.numpy as jnp
from jaxrl_agent.cli import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
path = compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"dir": path, "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _child(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != cc.ENV_VAR}
    out = subprocess.run([sys.executable, "-c", _CHILD, setting], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_cache_root_resolution():
    assert cc.cache_root(env={}).endswith(os.path.join(".cache", "jaxrl_agent", "xla"))
    assert cc.cache_root(env={"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "jaxrl_agent", "xla")
    assert cc.cache_root(env={cc.ENV_VAR: "/y", "XDG_CACHE_HOME": "/x"}) == "/y"
    for off in ("off", "OFF", "0", "none"):
        assert cc.cache_root(env={cc.ENV_VAR: off}) is None
    assert cc.cache_root("/z", env={cc.ENV_VAR: "off"}) == "/z"  # the CLI flag wins over the variable
    assert cc.cache_root("off", env={cc.ENV_VAR: "/y"}) is None


def test_cache_dir_is_keyed_by_versions_and_host():
    import jax
    import jaxlib

    d = cc.cache_dir("/root_dir")
    name = os.path.basename(d)
    assert os.path.dirname(d) == "/root_dir"
    assert f"jax{jax.__version__}" in name and f"jaxlib{jaxlib.__version__}" in name
    assert cc.cache_dir("/root_dir") == d  # stable: the same host finds its own entries


def test_second_process_loads_the_first_ones_compile(tmp_path):
    first = _child(str(tmp_path))
    assert first["dir"].startswith(str(tmp_path)) and os.listdir(first["dir"])
    assert first["misses"] >= 1
    second = _child(str(tmp_path))
    assert second["dir"] == first["dir"]
    assert second["hits"] >= 1 and second["misses"] == 0


def test_off_writes_nothing(tmp_path):
    res = _child("off")
    assert res["dir"] is None and res["hits"] == 0 and res["misses"] == 0


def test_unwritable_root_runs_without_a_cache(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cc.enable(str(blocker / "sub")) is None
    assert cc.ENV_VAR in capsys.readouterr().out
