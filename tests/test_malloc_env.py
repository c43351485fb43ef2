"""malloc_env: when the entry points re-exec under tcmalloc, and that they really do."""
import os
import subprocess
import sys

import pytest

from jaxrl_agent.cli import malloc_env as M

LIB = "libtcmalloc_minimal.so.4"


def test_env_preloads_tcmalloc_once():
    env = M.tcmalloc_env({"PATH": "/bin"}, system="linux", library=LIB)
    assert env["LD_PRELOAD"] == LIB and env["PATH"] == "/bin"
    assert env[M._REPORT_VAR] == M._REPORT_BYTES
    # the re-executed process sees the guard (and the preload): no second exec
    assert M.tcmalloc_env(env, system="linux", library=LIB) is None


def test_env_keeps_other_preloads_and_user_settings():
    env = M.tcmalloc_env({"LD_PRELOAD": "libfoo.so", M._REPORT_VAR: "5"}, system="linux", library=LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:libfoo.so"
    assert env[M._REPORT_VAR] == "5"


@pytest.mark.parametrize("environ,system,library", [
    ({M.OPT_OUT_VAR: "default"}, "linux", LIB),  # opted out
    ({M.OPT_OUT_VAR: "DEFAULT"}, "linux", LIB),
    ({}, "darwin", LIB),  # not Linux
    ({}, "linux", None),  # not installed
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, "linux", LIB),  # the user preloads it already
])
def test_env_leaves_the_process_alone(environ, system, library):
    assert M.tcmalloc_env(environ, system=system, library=library) is None


def test_without_tcmalloc_drops_only_tcmalloc():
    env = M.without_tcmalloc({"LD_PRELOAD": f"{LIB}:libfoo.so", M._GUARD_VAR: "1", "X": "y"})
    assert env["LD_PRELOAD"] == "libfoo.so" and env["X"] == "y"
    assert env[M.OPT_OUT_VAR] == "default" and M._GUARD_VAR not in env
    assert "LD_PRELOAD" not in M.without_tcmalloc({"LD_PRELOAD": LIB})


PROBE = ("from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc, tcmalloc_active; "
         "reexec_with_tcmalloc(); import sys; print('ACTIVE' if tcmalloc_active() else 'PLAIN', sys.argv[1:])")


@pytest.mark.skipif(M.find_tcmalloc() is None, reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
def test_reexec_preloads_tcmalloc_and_keeps_the_arguments():
    base = M.without_tcmalloc(dict(os.environ))
    base.pop(M.OPT_OUT_VAR)
    out = subprocess.run([sys.executable, "-c", PROBE, "a", "--b=c"], env=base, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "ACTIVE ['a', '--b=c']"
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, M.OPT_OUT_VAR: "default"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "PLAIN []"
