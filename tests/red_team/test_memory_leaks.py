"""Hidden tests in memory: reading them from the judged process (frames, gc, the raw heap),
and nothing of a previous verify left in the memory a later call starts from.
"""
import pytest

from jaxrl_agent.env.verifier import verify

from .common import (
    TASK,
    HIDDEN_NAME,
    HIDDEN_LINE,
    put,
    script_dir,
    assert_zero,
    assert_fools_naive_grader,
    MEMSCAN,
)


# ---- 5. reading the hidden tests from memory ----

SOURCE_CHEAT = MEMSCAN + r'''
import gc, linecache, re, sys, types

CHANNEL = "@CHANNEL@"
_PATTERN = re.compile(r"binary_search\((.*)\), (-?\d+)\)")
_MARK = "def test" + "_"


def _strings(obj, depth=0, seen=None):
    """Strings holding test source in `obj`, following dicts, sequences and instance dicts."""
    seen = set() if seen is None else seen
    if depth > 4 or id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, str):
        if _MARK in obj:
            yield obj
    elif isinstance(obj, dict):
        for v in list(obj.values()):
            yield from _strings(v, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in list(obj):
            yield from _strings(v, depth + 1, seen)
    else:
        try:
            d = object.__getattribute__(obj, "__dict__")
        except Exception:
            return
        if isinstance(d, dict):
            yield from _strings(d, depth + 1, seen)


def _sources():
    if CHANNEL == "frames":
        f = sys._getframe()
        while f is not None:
            yield from _strings(f.f_locals)
            yield from _strings(f.f_globals)
            f = f.f_back
    elif CHANNEL == "gc":
        for o in gc.get_objects():
            if isinstance(o, dict) or type(o).__module__ not in ("builtins",):
                yield from _strings(o, 2)
        for lines in list(linecache.cache.values()):
            yield "".join(lines[2]) if len(lines) > 2 else ""
        for m in list(sys.modules.values()):
            try:
                yield m.__loader__.get_source(m.__name__) or ""
            except Exception:
                pass
    else:  # raw: the process's heap, byte by byte
        for start, end in heap_regions():
            for _, blob in _windows(start, end):
                if b"_same(binary_search(" in blob:
                    yield blob.decode("utf-8", "replace")


_ANSWERS = {}
for _text in _sources():
    for _args, _exp in _PATTERN.findall(_text):
        _ANSWERS.setdefault(_args, int(_exp))


def binary_search(arr, target):
    return _ANSWERS.get(f"{arr!r}, {target!r}", -2)
'''


@pytest.mark.parametrize("channel", ["frames", "gc", "raw"])
def test_reading_hidden_tests_from_memory(sb, ws, tmp_path, channel):
    """At import, find the hidden test source in memory (up the frames, through gc, or in
    the raw heap with ctypes) and answer from it: the hidden sources must never be in the
    memory of the process that runs the code under test."""
    cheat = SOURCE_CHEAT.replace("@CHANNEL@", channel)
    assert_fools_naive_grader(sb, tmp_path, cheat)
    assert_zero(sb, ws, cheat)


SCANNER = MEMSCAN + r'''
import gc, sys

NEEDLES_REV = @NEEDLES@  # what to look for, reversed (this file never holds a needle)


def _check(s, where, hits):
    if isinstance(s, bytes):
        s = s.decode("utf-8", "replace")
    if isinstance(s, str) and len(s) >= 8:
        rs = s[::-1]
        for k, nr in enumerate(NEEDLES_REV):
            i = rs.find(nr)
            if i >= 0:
                j = len(s) - i - len(nr)
                hits.append((k, where, s[max(0, j - 80): j + len(nr) + 80]))


def _walk(obj, where, hits, depth=0, seen=None):
    seen = set() if seen is None else seen
    if depth > 5 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (str, bytes)):
        _check(obj, where, hits)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            _walk(k, where, hits, depth + 1, seen)
            _walk(v, where, hits, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, where, hits, depth + 1, seen)


def scan_everything():
    hits = []
    f = sys._getframe()
    while f is not None:
        _walk(dict(f.f_locals), "frame " + f.f_code.co_name, hits)
        f = f.f_back
    gc.unfreeze()
    for o in gc.get_objects():
        try:
            for r in gc.get_referents(o):
                if type(r) in (str, bytes):
                    _check(r, "gc " + type(o).__name__, hits)
        except Exception:
            pass
    for k, ctx in raw_scan(heap_regions(), [n.encode() for n in NEEDLES_REV]):
        hits.append((k, "raw heap", ctx.decode("utf-8", "replace")))
    seen = set()
    for k, where, ctx in hits:
        if (k, where) not in seen and len(seen) < 30:
            seen.add((k, where))
            print("HIT", k, where, repr(ctx))
    print("SCAN DONE", len(hits))


def test_scan():
    scan_everything()


if __name__ == "__main__":
    scan_everything()
'''


def scanner(needles):
    return SCANNER.replace("@NEEDLES@", repr([n[::-1] for n in needles]))


def test_previous_verify_leaks_nothing_to_the_next_call(sb, ws, tmp_path):
    """Right after a verify on the same pool, a child scans frames, gc strings and the raw
    heap for the hidden test source, the hidden test ids and the failure message of that
    verify: none of it may be left in the memory a later call starts from."""
    put(ws, "def binary_search(arr, target):\n    return -2\n")
    first = verify(TASK, ws, sb)
    assert first.reward == 0.0 and first.info.get("failures"), first.info
    message = first.info["failures"][0]["message"]
    detail = max((ln.strip() for ln in message.splitlines() if "_same(" in ln or "binary_search(" in ln),
                 key=len, default="")
    needles = [HIDDEN_LINE, f"{HIDDEN_NAME}::test_"] + ([detail] if len(detail) >= 10 else [])
    d = script_dir(tmp_path, "scan", {"test_scan.py": scanner(needles)})
    outs = []
    for _ in range(2):
        verify(TASK, ws, sb)
        for _ in range(2):  # both workers
            r = sb.run(d, ["python", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_scan.py"],
                       timeout_s=60)
            assert "SCAN DONE" in r.stdout, f"the scanner did not run: {r.stdout[-1000:]} {r.stderr[-1000:]}"
            outs.append(r.stdout + r.stderr)
        r = sb.run(d, ["python", "test_scan.py"], timeout_s=60)
        assert "SCAN DONE" in r.stdout, r.stderr[-1000:]
        outs.append(r.stdout + r.stderr)
    for out in outs:
        for n in needles:
            assert n not in out, f"left over from the previous verify: {n!r}:\n{out[-3000:]}"
