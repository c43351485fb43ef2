"""Shared constants and helpers of the red team (see the package docstring): the task, the
cheat/`verify` assertions, the naive-grader and plain-pytest controls, raw memory reading.
"""
import json
import os

from jaxrl_agent.env.tasks import binary_search_task
from jaxrl_agent.env.verifier import verify


# The repository root (tests/red_team/common.py -> three levels up).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = binary_search_task()
SRC = "bsearch.py"
FIXED = TASK.reference_files[SRC]
BUGGY = TASK.files[SRC]
HIDDEN_NAME = "test_bsearch_hidden.py"
HIDDEN = TASK.hidden_tests[HIDDEN_NAME]
N_HIDDEN = len(TASK.metadata["hidden_kinds"])
HIDDEN_IDS = [f"{HIDDEN_NAME}::test_{k}_1" for k in TASK.metadata["hidden_kinds"]]
# A line only the hidden tests have (the dev tests never use negatives or `_same`).
HIDDEN_LINE = "assert _same(binary_search([-9, -4, -1, 0, 6], -4), 1)"
assert HIDDEN_LINE in HIDDEN and all(HIDDEN_LINE not in t for t in TASK.dev_tests.values())


def put(ws, text, name=SRC):
    with open(os.path.join(ws, name), "w") as f:
        f.write(text)


def script_dir(tmp_path, name, files):
    d = tmp_path / name
    d.mkdir(parents=True)
    for rel, text in files.items():
        (d / rel).write_text(text)
    return d


def assert_zero(sb, ws, cheat, **kw):
    """The cheat in `bsearch.py` must earn nothing; `verify` must answer, not raise."""
    put(ws, cheat)
    res = verify(TASK, ws, sb, **kw)
    assert res.reward == 0.0, f"the cheat earned reward {res.reward}: {res.info}"
    # "sandbox_error" means "outcome unknown": the rollout drops such an episode from the
    # update, so code that can cause one escapes its penalty.
    assert res.info.get("reason") != "sandbox_error", f"the code under test caused a sandbox error: {res.info}"
    return res


def assert_honest_fix_still_passes(sb, ws, calls=2):
    put(ws, FIXED)
    for _ in range(calls):  # several calls: every worker of the pool
        res = verify(TASK, ws, sb)
        assert res.reward == 1.0, f"an honest fix no longer passes: {res.info}"


# ---- controls: the cheat is real ----

NAIVE_GRADER = r'''"""A naive in-process grader (trusted code, run inside the sandbox): the hidden tests run
in the same process as the code under test, with a nonce-tagged report pipe and a tamper
check (builtins, the test module's own functions), like the design the red team attacks."""
import builtins, json, os, secrets, sys, types

HIDDEN = "test_bsearch_hidden.py"
src = open(HIDDEN).read()
os.unlink(HIDDEN)  # the source lives in memory only


class _Reporter:
    def __init__(self, fd, nonce):
        self._write, self._dumps, self._fd, self._nonce = os.write, json.dumps, fd, nonce
        self._getpid = os.getpid
        self._before = {k: id(v) for k, v in vars(builtins).items()}
        self._modules = []
        self._memory = {HIDDEN: src}

    def _emit(self, **rec):
        rec["nonce"], rec["pid"] = self._nonce, self._getpid()
        self._write(self._fd, (self._dumps(rec) + "\n").encode())

    def _module_tampering(self):
        return [n for mod, originals in self._modules for n, c in originals.items()
                if getattr(vars(mod).get(n), "__code__", None) is not c]

    def finish(self):
        tampered = [k for k, v in self._before.items() if id(vars(builtins).get(k)) != v]
        self._emit(event="end", exitstatus=0, tampered=tampered + self._module_tampering())


def run_tests(rep):
    sys.path.insert(0, os.getcwd())
    name = HIDDEN[:-3]
    mod = types.ModuleType(name)
    mod.__file__ = os.path.abspath(HIDDEN)
    sys.modules[name] = mod
    code = compile(src, mod.__file__, "exec")
    originals = {c.co_name: c for c in code.co_consts if isinstance(c, types.CodeType)}
    exec(code, mod.__dict__)
    rep._modules.append((mod, originals))
    for fn in [n for n in list(vars(mod)) if n.startswith("test_")]:
        try:
            vars(mod)[fn]()
            outcome = "passed"
        except Exception:
            outcome = "failed"
        rep._emit(event="test", id=f"{HIDDEN}::{fn}", when="call", outcome=outcome, message="")
    rep.finish()


nonce = secrets.token_hex(16)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        run_tests(_Reporter(w, nonce))
    finally:
        os._exit(0)
os.close(w)
data = b""
while True:
    chunk = os.read(r, 1 << 16)
    if not chunk:
        break
    data += chunk
_, status = os.waitpid(pid, 0)
passed, end, forged, pids = set(), None, 0, set()
for line in data.decode(errors="replace").splitlines():
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or rec.pop("nonce", None) != nonce:
        forged += 1
        continue
    pids.add(rec.get("pid"))
    if rec.get("event") == "test" and rec.get("outcome") == "passed":
        passed.add(rec.get("id"))
    elif rec.get("event") == "end":
        end = rec
n_tests = src.count("\ndef test_")
ok = (len(passed) == n_tests and end is not None and not end.get("tampered") and not forged
      and len(pids) == 1 and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
print("NAIVE " + json.dumps({"reward": 1.0 if ok else 0.0, "passed": len(passed), "of": n_tests,
                             "end": end, "forged": forged}))
'''


def naive_grade(sb, tmp_path, cheat) -> dict:
    """Run the hidden tests on `cheat` with the naive in-process grader (in the sandbox)."""
    d = script_dir(tmp_path, "naive", {SRC: cheat, HIDDEN_NAME: HIDDEN, "naive_grader.py": NAIVE_GRADER})
    r = sb.run(d, ["python", "naive_grader.py"], timeout_s=30)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("NAIVE ")]
    assert lines, f"naive grader gave no verdict (rc {r.returncode}): {r.stdout[-800:]}\n{r.stderr[-1500:]}"
    return json.loads(lines[-1][len("NAIVE "):])


def assert_fools_naive_grader(sb, tmp_path, cheat):
    v = naive_grade(sb, tmp_path, cheat)
    assert v["reward"] == 1.0, f"control: the cheat does not even fool the naive grader: {v}"


def assert_fools_plain_pytest(sb, tmp_path, cheat, tests=None, count=N_HIDDEN):
    """Control: plain pytest on the hidden (or given) tests on disk passes them all."""
    tests = dict(tests or {HIDDEN_NAME: HIDDEN})
    d = script_dir(tmp_path, "plain", {SRC: cheat, **tests})
    r = sb.run(d, ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], timeout_s=30)
    assert f"{count} passed" in r.stdout and "failed" not in r.stdout, \
        f"control: plain pytest is not fooled: {r.stdout[-1500:]}\n{r.stderr[-800:]}"


# ---- raw memory reading (sections 5 and 8) ----

# Raw memory reading for sandboxed scripts: a page is readable iff writing it to a pipe
# works (EFAULT otherwise), so nothing here can crash on an unmapped address.
MEMSCAN = r'''
import ctypes as _ct, gc as _gc, os as _os

_libc = _ct.CDLL(None, use_errno=True)
_libc.write.argtypes = [_ct.c_int, _ct.c_void_p, _ct.c_size_t]
_libc.write.restype = _ct.c_ssize_t
_libc.getauxval.argtypes = [_ct.c_ulong]
_libc.getauxval.restype = _ct.c_ulong
_libc.sbrk.argtypes = [_ct.c_long]
_libc.sbrk.restype = _ct.c_void_p
_PAGE = 4096
_pr, _pw = _os.pipe()


def _readable(addr):
    n = _libc.write(_pw, addr, _PAGE)
    if n > 0:
        _os.read(_pr, 1 << 16)
    return n == _PAGE


def _windows(start, end):
    """Readable memory in [start, end) as (address, bytes) windows of <= 1 MiB (overlapping)."""
    run, run_start = [], None
    for a in range(start, end, _PAGE):
        if _readable(a):
            if run_start is None:
                run_start = a
            run.append(_ct.string_at(a, _PAGE))
            if len(run) == 256:
                yield run_start, b"".join(run)
                run, run_start = [run[-1]], a
        elif run:
            yield run_start, b"".join(run)
            run, run_start = [], None
    if run:
        yield run_start, b"".join(run)


def stack_regions(limit=128 << 10):
    """The top of the initial stack: argv and the environment strings end at AT_EXECFN."""
    execfn = _libc.getauxval(31)
    if not execfn:
        return []
    top = (execfn + len(_ct.string_at(execfn)) + _PAGE) & ~(_PAGE - 1)
    return [(top - limit, top)]


def heap_regions(limit=256 << 20):
    """The brk heap (below sbrk(0)) and every 1 MiB block that holds a gc-tracked object."""
    regions = []
    brk = _libc.sbrk(0) or 0
    if brk:
        end = (brk + _PAGE - 1) & ~(_PAGE - 1)
        start = end
        while end - start < limit and _readable(start - _PAGE):
            start -= _PAGE
        regions.append((start, end))
    blocks = sorted({id(o) >> 20 for o in _gc.get_objects()})
    return regions + [(b << 20, (b + 1) << 20) for b in blocks[: limit >> 20]]


def raw_scan(regions, needles_reversed):
    """Find needles in raw memory. They are given reversed (bytes) and only reversed copies
    of memory are searched, so this program never holds a needle itself."""
    hits = []
    for start, end in regions:
        for _, blob in _windows(start, end):
            rev = blob[::-1]
            for k, nr in enumerate(needles_reversed):
                i = rev.find(nr)
                if i >= 0:
                    j = len(blob) - i - len(nr)
                    hits.append((k, blob[max(0, j - 80): j + len(nr) + 80]))
    return hits
'''
