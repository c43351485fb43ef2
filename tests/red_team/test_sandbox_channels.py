"""Channels around the sandbox: SysV IPC and kernel keyrings outliving a call, processes
outside the call (visible, signalable, surviving), the trainer's environment.
"""
import json
import os
import platform
import random
import secrets

import pytest

from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tools import create_workspaces
from jaxrl_agent.env.verifier import verify

from .common import TASK, put, script_dir, MEMSCAN


# ---- 6. SysV IPC and kernel keyrings outlive a call ----

IPC_COMMON = r'''import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.msgrcv.restype = ctypes.c_ssize_t
IPC_CREAT, IPC_NOWAIT, SHM_RDONLY = 0o1000, 0o4000, 0o10000
BAD = ctypes.c_void_p(-1).value
key = int(sys.argv[1])


class Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 64)]
'''

IPC_WRITER = IPC_COMMON + r'''
secret = sys.argv[2].encode()
q = libc.msgget(key, IPC_CREAT | 0o666)
sent = q >= 0 and all(libc.msgsnd(q, ctypes.byref(Msg(1, secret)), len(secret), IPC_NOWAIT) == 0
                      for _ in range(2))  # one copy is read back now (the control), one is left
back = Msg()
n = libc.msgrcv(q, ctypes.byref(back), 64, 0, IPC_NOWAIT) if sent else -1
print("queue round trip", n > 0 and back.mtext[:n] == secret)
s = libc.shmget(key, 4096, IPC_CREAT | 0o666)
addr = libc.shmat(s, None, 0) if s >= 0 else BAD
if addr not in (None, BAD):
    ctypes.memmove(addr, secret, len(secret))
print("shm round trip", addr not in (None, BAD) and ctypes.string_at(addr, len(secret)) == secret)
'''

IPC_READER = IPC_COMMON + r'''
q = libc.msgget(key, 0)
if q >= 0:
    m = Msg()
    n = libc.msgrcv(q, ctypes.byref(m), 64, 0, IPC_NOWAIT)
    if n > 0:
        print("queue gave", m.mtext[:n].decode(errors="replace"))
s = libc.shmget(key, 0, 0)
if s >= 0:
    addr = libc.shmat(s, None, SHM_RDONLY)
    if addr not in (None, BAD):
        print("shm gave", ctypes.string_at(addr, 64).split(b"\0")[0].decode(errors="replace"))
print("reader done")
'''


def _remove_ipc(key):
    """Remove what the attack left on the host (where IPC is not namespaced per call)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    q = libc.msgget(key, 0)
    if q >= 0:
        libc.msgctl(q, 0, None)  # IPC_RMID
    s = libc.shmget(key, 0, 0)
    if s >= 0:
        libc.shmctl(s, 0, None)


def test_sysv_ipc_does_not_survive_a_call(sb, tmp_path):
    """Call 1 leaves a message queue and a shared memory segment with a fixed key; later
    calls (either worker) must not find them: a channel between episodes, or from a verify
    run to the next episode's run_tests."""
    key, secret = random.randrange(1 << 24, 1 << 30), "jxa-ipc-" + secrets.token_hex(8)
    d = script_dir(tmp_path, "ipc", {"writer.py": IPC_WRITER, "reader.py": IPC_READER})
    try:
        w = sb.run(d, ["python", "writer.py", str(key), secret])
        assert "queue round trip True" in w.stdout and "shm round trip True" in w.stdout, \
            f"control: SysV IPC does not work inside one call: {w.stdout} {w.stderr[-800:]}"
        outs = []
        for _ in range(4):
            r = sb.run(d, ["python", "reader.py", str(key)])
            assert "reader done" in r.stdout, r.stderr[-800:]
            outs.append(r.stdout)
    finally:
        _remove_ipc(key)
    for out in outs:
        assert secret not in out, f"a later call read call 1's IPC object: {out}"


KEYRING_COMMON = r'''import ctypes, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
USER_KEYRING = ctypes.c_long(-4)  # KEY_SPEC_USER_KEYRING: one per uid, not per process
desc = sys.argv[1].encode()


def read(key_id):
    buf = ctypes.create_string_buffer(128)
    n = libc.syscall(KEYCTL, ctypes.c_long(11), ctypes.c_long(key_id), buf, ctypes.c_long(128))
    return buf.raw[:n] if n > 0 else b""
'''

KEYRING_WRITER = KEYRING_COMMON + r'''
secret = sys.argv[2].encode()
k = libc.syscall(ADD_KEY, b"user", desc, secret, ctypes.c_long(len(secret)), USER_KEYRING)
if k > 0:
    libc.syscall(KEYCTL, ctypes.c_long(15), ctypes.c_long(k), ctypes.c_long(120))  # expire in 2 min
print("keyring round trip", k > 0 and read(k) == secret, ctypes.get_errno())
'''

KEYRING_READER = KEYRING_COMMON + r'''
k = libc.syscall(KEYCTL, ctypes.c_long(10), USER_KEYRING, b"user", desc, ctypes.c_long(0))  # SEARCH
if k > 0:
    print("keyring gave", read(k).decode(errors="replace"))
    libc.syscall(KEYCTL, ctypes.c_long(9), ctypes.c_long(k), USER_KEYRING)  # unlink (clean up)
print("reader done")
'''


def test_kernel_keyring_does_not_survive_a_call(sb, tmp_path):
    """The kernel's per-uid user keyring is neither a mount, a PID nor an IPC namespace
    object: a key added by call 1 must not be readable by later calls of the same worker."""
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("keyctl syscall numbers known for x86_64 and aarch64 only")
    desc, secret = "jxa-" + secrets.token_hex(6), "jxa-key-" + secrets.token_hex(8)
    d = script_dir(tmp_path, "keys", {"writer.py": KEYRING_WRITER, "reader.py": KEYRING_READER})
    w = sb.run(d, ["python", "writer.py", desc, secret])
    if "keyring round trip True" not in w.stdout:  # the sandbox's seccomp filter refuses keyctl
        assert "keyring round trip False 1" in w.stdout, (w.stdout, w.stderr[-300:])  # EPERM
        return
    outs = []
    for _ in range(4):  # both workers; the uid of the writer's worker sees its own keyring
        r = sb.run(d, ["python", "reader.py", desc])
        assert "reader done" in r.stdout, r.stderr[-800:]
        outs.append(r.stdout)
    assert not any(secret in o for o in outs), f"a later call read call 1's key: {outs}"


# ---- 7. processes outside the call ----

PID_PROBE = r'''import json, os, sys
me, limit = os.getpid(), int(sys.argv[1])
targets = [int(a) for a in sys.argv[2:]]
visible, signalable = [], []
for p in sorted(set(range(1, limit)) | set(targets)):
    if p == me:
        continue
    try:
        os.kill(p, 0)
        signalable.append(p)
    except PermissionError:
        visible.append(p)
    except (ProcessLookupError, OSError):
        pass
print("PIDS " + json.dumps({"me": me, "ppid": os.getppid(), "visible": visible,
                            "signalable": signalable, "proc": os.path.isdir("/proc/1")}))
'''


def test_processes_outside_the_call_are_invisible(sb, tmp_path):
    """kill(pid, 0) over a pid range tells which processes exist (EPERM) even when they
    cannot be signalled: the code must see and signal only its own call's processes."""
    d = script_dir(tmp_path, "pids", {"probe.py": PID_PROBE})
    host = [os.getpid(), os.getppid(), *sb.worker_pids()]
    r = sb.run(d, ["python", "probe.py", str(1 << 16), *map(str, host)], timeout_s=30)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PIDS ")]
    assert lines, r.stderr[-1000:]
    v = json.loads(lines[0][5:])
    assert not v["signalable"], f"the child can signal processes outside its call: {v['signalable'][:20]}"
    seen_host = [p for p in host if p in v["visible"]]
    assert not seen_host, f"the child sees the trainer/worker processes {seen_host}"
    assert len(v["visible"]) <= 5, f"the child sees {len(v['visible'])} other processes: {v['visible'][:20]}"
    if sb.isolation == "namespaces":
        assert v["me"] < 1000, f"no PID namespace: the child is pid {v['me']}"


SURVIVOR = r'''import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(1, f"survivor {os.getpid()}\n".encode())
        for _ in range(3000):  # keeps leaving a beacon where the next call can see it
            try:
                with open("/tmp/jxa-beacon", "w") as f:
                    f.write(str(time.time()))
            except OSError:
                pass
            time.sleep(0.02)
        os._exit(0)
    os._exit(0)
time.sleep(0.3)
print("call 1 done")
'''

SURVIVOR_CHECK = r'''import os, sys, time
time.sleep(0.3)
pid = int(sys.argv[1])
try:
    os.kill(pid, 0)
    alive = True
except PermissionError:
    alive = True
except OSError:
    alive = False
print("CHECK alive" if alive else "CHECK gone", "beacon" if os.path.exists("/tmp/jxa-beacon") else "")
'''


def test_double_forked_survivor_is_gone_next_call(sb, tmp_path):
    """A setsid() double-forked grandchild of call 1 must be dead before call 2: neither
    visible by pid nor still writing into the next call's /tmp."""
    d = script_dir(tmp_path, "surv", {"s.py": SURVIVOR, "c.py": SURVIVOR_CHECK})
    r = sb.run(d, ["python", "s.py"])
    pids = [int(ln.split()[1]) for ln in r.stdout.splitlines() if ln.startswith("survivor ")]
    assert pids and "call 1 done" in r.stdout, f"control: the double fork did not run: {r}"
    for _ in range(4):
        c = sb.run(d, ["python", "c.py", str(pids[0])])
        assert c.stdout.startswith("CHECK gone"), f"call 1's grandchild outlived it: {c.stdout!r}"
        assert "beacon" not in c.stdout


# ---- 8. the trainer's environment ----

ENV_NAME = "JXA_RED_TEAM_TOKEN"

ENV_SCAN = MEMSCAN + r'''
import os, sys

_NAME_REV = b"=NEKOT_MAET_DER_AXJ"  # the variable's name, reversed


def env_leaks():
    """Where the trainer's variable shows: /proc/self/environ, os.environ, the initial stack."""
    name = _NAME_REV[::-1]
    found = []
    try:
        with open("/proc/self/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(name):
                    found.append(("/proc/self/environ", item[len(name):]))
    except OSError:
        pass
    for k, v in os.environb.items():
        if k + b"=" == name:
            found.append(("os.environ", v))
    stack = b"".join(blob for start, end in stack_regions() for _, blob in _windows(start, end))
    i = stack.find(name)
    while i >= 0:
        found.append(("initial stack", stack[i + len(name): stack.find(b"\0", i)]))
        i = stack.find(name, i + 1)
    return found, stack


def report(marker=None):
    found, stack = env_leaks()
    print("STACK", len(stack), "argv-marker" if marker and marker.encode() in stack else "")
    for where, value in found:
        print("FOUND", where, value.decode(errors="replace"))


def test_env():
    report()


if __name__ == "__main__":
    report(sys.argv[1] if len(sys.argv) > 1 else None)
'''

ENV_CHEAT = MEMSCAN + r'''
import os

_NAME_REV = b"=NEKOT_MAET_DER_AXJ"


def binary_search(arr, target):
    """Exfiltrate the trainer's variable through the failure message verify reports."""
    name = _NAME_REV[::-1]
    stack = b"".join(blob for start, end in stack_regions() for _, blob in _windows(start, end))
    i = stack.find(name)
    raise ValueError("FOUND " + (stack[i + len(name): stack.find(b"\0", i)].decode(errors="replace")
                                 if i >= 0 else "nothing") + " in %d bytes" % len(stack))
'''


def test_trainer_environment_is_not_readable(tmp_path):
    """A secret in the trainer's environment (API keys, tokens) must not reach the code:
    not through /proc/self/environ, os.environ, nor the initial stack a forked child
    inherits (AT_EXECFN, then ~128 KiB back over the environment strings), whether the
    child is exec'd, runs an in-process pytest or serves a verify."""
    secret = secrets.token_hex(16)
    marker = "jxa-argv-" + secrets.token_hex(4)
    d = script_dir(tmp_path, "env", {"scan.py": ENV_SCAN, "test_env_scan.py": ENV_SCAN})
    ws = create_workspaces({**TASK.files, **TASK.dev_tests}, str(tmp_path / "ws"), 1)[0]
    put(ws, ENV_CHEAT)
    os.environ[ENV_NAME] = secret
    try:
        with Sandbox(num_workers=1, timeout_s=20, memory_mb=512) as fresh:
            exec_run = fresh.run(d, ["python", "scan.py", marker])
            pytest_run = fresh.run(d, ["python", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                       "test_env_scan.py"])
            res = verify(TASK, ws, fresh)
    finally:
        os.environ.pop(ENV_NAME, None)
    assert "argv-marker" in exec_run.stdout, \
        f"control: the stack scan does not even find its own argv: {exec_run.stdout} {exec_run.stderr[-800:]}"
    assert "STACK" in pytest_run.stdout and "STACK 0" not in pytest_run.stdout, pytest_run.stdout[-800:]
    assert res.reward == 0.0
    for what, out in [("exec'd child", exec_run.stdout + exec_run.stderr),
                      ("in-process pytest", pytest_run.stdout + pytest_run.stderr),
                      ("verify", json.dumps(res.info))]:
        assert secret not in out, f"the trainer's secret leaked to the {what}:\n{out[-2000:]}"
