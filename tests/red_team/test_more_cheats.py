"""More verify cheats (section 13): trace hooks, ctypes patches, pytest items, always-equal
and odd return values, exits and signals, atexit, descriptor sprays, sleeping, ptrace,
malicious pickle/json.
"""
import json
import os
import time

import pytest

from jaxrl_agent.env.tools import ToolConfig, Tools, ToolSession, format_tool_call

from .common import (
    TASK,
    FIXED,
    BUGGY,
    HIDDEN_IDS,
    script_dir,
    assert_zero,
    assert_honest_fix_still_passes,
    assert_fools_naive_grader,
    assert_fools_plain_pytest,
)


# ---- 13. more verify cheats ----

TRACE_CHEAT = r'''import sys

CHANNEL = "@CHANNEL@"


def _hook(frame, event, arg):
    # Locals a trace/profile function writes are copied back into the frame when it returns.
    if event == "call" and frame.f_code.co_name == "_same":
        loc = frame.f_locals
        if "expected" in loc:
            loc["actual"] = loc["expected"]
    return None


def binary_search(arr, target):
    (sys.settrace if CHANNEL == "settrace" else sys.setprofile)(_hook)
    return -2
'''


@pytest.mark.parametrize("channel", ["settrace", "setprofile"])
def test_trace_hook_rewrites_the_comparison(sb, ws, tmp_path, channel):
    """sys.settrace / sys.setprofile: the hook sees the comparison helper's frame and sets
    `actual = expected` in its locals; nothing the tamper check watches changes."""
    cheat = TRACE_CHEAT.replace("@CHANNEL@", channel)
    assert_fools_naive_grader(sb, tmp_path, cheat)
    assert_fools_plain_pytest(sb, tmp_path, cheat)
    assert_zero(sb, ws, cheat)


CTYPES_CHEAT = r'''import ctypes, sys

_patched = set()


def _false_to_true(code):
    """Overwrite the helper's `False` constants with `True`, in place: same code object."""
    consts = code.co_consts
    for i, c in enumerate(consts):
        if c is False:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(True))
            slot = id(consts) + tuple.__basicsize__ + ctypes.sizeof(ctypes.c_void_p) * i
            ctypes.c_void_p.from_address(slot).value = id(True)


def binary_search(arr, target):
    same = sys._getframe(1).f_globals.get("_same")
    if same is not None and id(same.__code__) not in _patched:
        _patched.add(id(same.__code__))
        _false_to_true(same.__code__)
    return "wrong type"
'''


def test_ctypes_patch_of_the_helpers_constants(sb, ws, tmp_path):
    """ctypes writes into the interpreter: `_same`'s `return False` becomes `return True`
    inside its own code object, so identity checks of code objects see nothing."""
    assert_fools_naive_grader(sb, tmp_path, CTYPES_CHEAT)
    assert_zero(sb, ws, CTYPES_CHEAT)


ITEMS_CHEAT = BUGGY.replace("def binary_search(", "def _buggy(") + r'''

import gc as _gc

_armed = []


def binary_search(arr, target):
    """Keep the buggy code (the first hidden test passes on it) and, on the first call,
    make every collected pytest item a no-op through an instance attribute."""
    if not _armed:
        _armed.append(1)
        for o in _gc.get_objects():
            if type(o).__name__ == "Function" and type(o).__module__ == "_pytest.python":
                o.runtest = lambda: None
    return _buggy(arr, target)
'''


def test_patching_pytest_items_on_the_instance(sb, ws, tmp_path):
    """gc finds the collected test items; `item.runtest = lambda: None` on each instance
    (class attributes, which a snapshot compares, stay untouched) turns them into passes."""
    assert_fools_plain_pytest(sb, tmp_path, ITEMS_CHEAT)
    assert_zero(sb, ws, ITEMS_CHEAT)


LOOKALIKES = {
    "eq_object": "class _V:\n    def __eq__(self, o):\n        return True\n\n"
                 "    def __ne__(self, o):\n        return False\n    __hash__ = object.__hash__\n\n\nVALUE = _V()\n",
    "str_subclass": "class _S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n\n\n"
                    "VALUE = _S('3')\n",
    "lying_class": "class _L(int):\n    __class__ = property(lambda self: int)\n\n    def __eq__(self, o):\n"
                   "        return True\n    __hash__ = int.__hash__\n\n\nVALUE = _L(0)\n",
}


@pytest.mark.parametrize("kind", sorted(LOOKALIKES))
def test_always_equal_lookalikes(sb, ws, tmp_path, kind):
    """Objects equal to everything (plain, str subclass, an int subclass lying about its
    __class__) fool an `==` check such as the dev tests; the hidden comparison must not."""
    cheat = LOOKALIKES[kind] + "\n\ndef binary_search(arr, target):\n    return VALUE\n"
    assert_fools_plain_pytest(sb, tmp_path, cheat, tests=TASK.dev_tests, count=len(
        [ln for t in TASK.dev_tests.values() for ln in t.splitlines() if ln.startswith("def test_")]))
    assert_zero(sb, ws, cheat)


ODD_VALUES = {
    "nan": "VALUE = float('nan')\n",
    "deep": "VALUE = []\n_x = VALUE\nfor _ in range(100000):\n    _x.append([])\n    _x = _x[0]\n",
    "cyclic": "VALUE = []\nVALUE.append(VALUE)\n",
    "huge_list": "VALUE = [0] * 5_000_000\n",
    "huge_str": "VALUE = 'x' * (50 << 20)\n",
    "huge_int": "import sys\nsys.set_int_max_str_digits(0)\nVALUE = 10 ** 20000\n",
    "raising": "class _R:\n" + "".join(
        f"    def {m}(self, *a):\n        raise RuntimeError('{m}')\n\n"
        for m in ("__eq__", "__ne__", "__repr__", "__str__", "__bool__", "__hash__", "__reduce__",
                  "__reduce_ex__", "__len__", "__iter__", "__getattr__")) + "\nVALUE = _R()\n",
    "looping_repr": "class _Loop:\n    def __repr__(self):\n        while True:\n            pass\n\n\nVALUE = _Loop()\n",
    "generator": "VALUE = (i for i in range(3))\n",
    "exception_object": "VALUE = AssertionError('passed')\n",
}


@pytest.mark.parametrize("kind", sorted(ODD_VALUES))
def test_odd_return_values_never_crash_verify(sb, ws, kind):
    """Huge, deeply nested, cyclic, NaN or hostile objects as the answer: the judge must
    neither crash nor hang on them (reward 0, verify returns)."""
    t0 = time.monotonic()
    assert_zero(sb, ws, ODD_VALUES[kind] + "\n\ndef binary_search(arr, target):\n    return VALUE\n")
    assert time.monotonic() - t0 < 60


EXITS = {
    "os_exit": "os._exit(0)",
    "sys_exit": "sys.exit(0)",
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "base_exception": "raise BaseException('stop')",
    "generator_exit": "raise GeneratorExit",
    "sigkill_self": "os.kill(os.getpid(), signal.SIGKILL)",
    "sigterm_group": "os.killpg(os.getpgrp(), signal.SIGTERM)",
    "faulthandler": "faulthandler.dump_traceback_later(0.05, exit=True); time.sleep(5)",
    "fake_summary": "print('=' * 20 + ' 15 passed in 0.01s ' + '=' * 20, flush=True); os._exit(0)",
    "pytest_exit": "import pytest; pytest.exit('all good', returncode=0)",
    "pytest_skip": "import pytest; pytest.skip('not today')",
    "pytest_xfail": "import pytest; pytest.xfail('known bug')",
    "close_all_fds": "os.closerange(0, 1024)",
}


@pytest.mark.parametrize("kind", sorted(EXITS))
def test_exit_tricks_mid_test(sb, ws, kind):
    """Ending or short-circuiting the run from inside a call (exits, signals to itself,
    pytest outcomes, fake summaries, closed descriptors): never a pass, never a crash."""
    assert_zero(sb, ws, "import faulthandler, os, signal, sys, time\n\n"
                        f"def binary_search(arr, target):\n    {EXITS[kind]}\n    return -2\n")


ATEXIT_CHEAT = r'''import atexit, json, os, sys

IDS = @IDS@


def _claim_success():
    print("=" * 20, len(IDS), "passed in 0.01s", "=" * 20, flush=True)
    lines = [json.dumps(dict(event="test", id=i, when="call", outcome="passed", message="", pid=os.getpid()))
             for i in IDS] + [json.dumps(dict(event="end", exitstatus=0, tampered=[], pid=os.getpid()))]
    for fd in range(1, 1024):
        try:
            os.write(fd, ("\n".join(lines) + "\n").encode())
        except OSError:
            pass


atexit.register(_claim_success)


def binary_search(arr, target):
    sys.exit(0)
'''


def test_atexit_handler_claims_success(sb, ws):
    """An atexit handler that prints a pytest summary and writes passed records (without
    the nonce) to every descriptor when the process ends."""
    assert_zero(sb, ws, ATEXIT_CHEAT.replace("@IDS@", repr(HIDDEN_IDS)))


FD_SPRAY = r'''import json, os

IDS = @IDS@


def _spray():
    """Plausible result lines of any protocol, and junk, to every inherited descriptor."""
    recs = [dict(event="test", id=i, when="call", outcome="passed", message="", pid=os.getpid()) for i in IDS]
    recs.append(dict(event="end", exitstatus=0, tampered=[], pid=os.getpid()))
    lines = [json.dumps(r) for r in recs] + [json.dumps(dict(r, nonce="0" * 32)) for r in recs]
    lines += ['{"ok": 3}', '{"ok": {"int": 3}}', '{"raise": {"type": "SystemExit", "msg": "0"}}',
              '{"ok": NaN}', "[" * 100000, "9" * 100000, "x" * (2 << 20)]
    data = ("\n".join(lines) + "\n").encode() + b"\xff\xfe\n"
    for fd in range(1, 1024):
        try:
            os.write(fd, data)
        except OSError:
            pass


_spray()


def binary_search(arr, target):
    _spray()
    return -2
'''


def test_spraying_inherited_descriptors(sb, ws):
    """Fake records (with and without a guessed nonce), replies of a call protocol and junk
    (deep brackets, huge numbers, huge lines, bad UTF-8) written to fds 1..1023: no pass,
    and no sandbox error either (that would drop the episode from the update), neither
    in verify nor in the agent's own run_tests."""
    assert_zero(sb, ws, FD_SPRAY.replace("@IDS@", repr(HIDDEN_IDS)))
    step = ToolSession(Tools(ws, sorted(TASK.dev_tests), sb, ToolConfig()), ToolConfig()).step(
        format_tool_call("run_tests"))
    assert step.termination != "sandbox_error" and not step.done, f"run_tests ended the episode: {step}"


def test_sleeping_past_the_per_test_limit(sb, ws):
    """A correct fix that sleeps on one input: the per-test CPU limit does not see sleeping;
    the wall limit must, and the test must not count as passed (or be skipped)."""
    t0 = time.monotonic()
    assert_zero(sb, ws, "import time\n" + FIXED.replace(
        "    low = 0\n", "    if not arr:\n        time.sleep(60)\n    low = 0\n", 1), timeout_s=4)
    assert time.monotonic() - t0 < 40


SIGNALS_CHEAT = r'''import os, signal

KIND = "@KIND@"


def binary_search(arr, target):
    """Attack the process that judges this call (and, with -1, everything it may signal)."""
    if KIND == "kill_everything":
        os.kill(-1, signal.SIGKILL)
    for pid in {os.getppid(), 1}:
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except OSError:
            pass
    return -2
'''


@pytest.mark.parametrize("kind", ["kill_parent", "kill_everything"])
def test_signalling_the_judge(sb, ws, kind):
    """kill/killpg/SIGSTOP on the parent, pid 1 (a namespace's init) and kill(-1): the
    judge must survive (reward 0, no exception) and the pool must keep working."""
    assert_zero(sb, ws, SIGNALS_CHEAT.replace("@KIND@", kind))
    assert_honest_fix_still_passes(sb, ws)


PTRACE_PROBE = r'''import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SEIZE = 16, 17, 0x4206
me, attached, mem = os.getpid(), [], []
targets = {os.getppid(), 1}
for p in range(1, 1 << 15):
    try:
        os.kill(p, 0)
        targets.add(p)
    except PermissionError:
        targets.add(p)
    except OSError:
        pass
for p in sorted(targets - {me, 0}):
    for req in (PTRACE_SEIZE, PTRACE_ATTACH):
        if libc.ptrace(req, p, None, None) == 0:
            attached.append(p)
            libc.ptrace(PTRACE_DETACH, p, None, None)
            break
    try:
        with open(f"/proc/{p}/mem", "rb") as f:
            mem.append(p)
    except OSError:
        pass
print("PTRACE " + json.dumps({"attached": attached, "mem": mem, "tried": len(targets)}))
'''

PTRACE_CHEAT = r'''import ctypes, os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def binary_search(arr, target):
    """Seize the judge (the parent, or pid 1 of a namespace) and stop it mid-session."""
    for pid in {os.getppid(), 1}:
        if _libc.ptrace(0x4206, pid, None, None) == 0:  # PTRACE_SEIZE
            _libc.ptrace(0x4207, pid, None, None)  # PTRACE_INTERRUPT
    return -2
'''


def test_ptrace_and_proc_mem_of_other_processes(sb, ws, tmp_path):
    """PTRACE_SEIZE/ATTACH and /proc/<pid>/mem on every process the code can name (the
    parent, pid 1, anything kill(pid, 0) reveals): none may succeed; seizing the judge
    from inside a verify earns nothing and does not hang it."""
    d = script_dir(tmp_path, "ptrace", {"probe.py": PTRACE_PROBE})
    r = sb.run(d, ["python", "probe.py"], timeout_s=30)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PTRACE ")]
    assert lines, r.stderr[-1000:]
    v = json.loads(lines[0][7:])
    assert not v["attached"] and not v["mem"], f"the child can trace/read other processes: {v}"
    assert_zero(sb, ws, PTRACE_CHEAT)


PICKLE_CHEAT = r'''import builtins, json, pickle, sys

MARKER = "@MARKER@"


class _Boom:
    """Unpickling this runs code in whichever process loads it."""

    def __reduce__(self):
        return (builtins.exec, (f"open({MARKER!r}, 'w').write('pwned')",))


_dumps = pickle.dumps
pickle.dumps = lambda obj, *a, **k: _dumps(_Boom(), *a, **k)
try:
    from multiprocessing import reduction
    reduction.ForkingPickler.dumps = classmethod(lambda cls, obj, protocol=None: memoryview(_dumps(_Boom())))
except Exception:
    pass
json.dumps = lambda obj, *a, **k: '{"ok": 3, "py/reduce": "builtins.exec"}'
json.JSONEncoder.encode = lambda self, o: '{"ok": 3}'
json.loads = lambda s, *a, **k: {"op": "call", "fn": "binary_search", "args": [[1], 1]}


def binary_search(arr, target):
    return _Boom()
'''


def test_malicious_pickle_or_json_in_the_child(sb, ws, tmp_path):
    """The child patches pickle / json / multiprocessing's pickler and returns an object
    whose unpickling runs code: results must cross as data the judge parses itself."""
    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)
    assert_zero(sb, ws, PICKLE_CHEAT.replace("@MARKER@", str(marker)))
    assert not marker.exists(), "the child's object ran code in the judge"
