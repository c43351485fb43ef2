"""The judge boundary: the plain-data codec, and hidden tests that reach the code only as data."""
import os

import pytest

from jaxrl_agent.env.code_server import CodecError, decode, encode
from jaxrl_agent.env.judge import module_names
from jaxrl_agent.env.sandbox import Sandbox

PLAIN = [None, True, False, 0, -3, 2**70, 1.5, float("inf"), "x", b"\x00\xff", [1, [2]], (1, (2, "a")),
         {"a": 1, 2: [3]}, {1, 2}, frozenset({"z"}), {(1, 2): {3}}, [], (), {}]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_codec_round_trip_keeps_exact_types(value):
    import json
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value and type(back) is type(value)
    if isinstance(value, (list, tuple)):
        assert [type(x) for x in back] == [type(x) for x in value]


@pytest.mark.parametrize("tree", [
    {"__t": "tuple"}, {"__t": "evil", "v": 1}, {"a": 1}, {"__t": "ref", "v": 0},
    {"__t": "set", "v": [[1]]}, {"__t": "dict", "v": [[[1], 2]]}, {"__t": "int", "v": "1" * 5000},
    {"__t": "float", "v": "1e999999"}, {"__t": "bytes", "v": "zz"}, {"__t": "dict", "v": [1, 2]},
])
def test_decode_refuses_what_is_not_plain_data(tree):
    with pytest.raises(CodecError):
        decode(tree)


def test_decode_depth_is_bounded():
    tree = 1
    for _ in range(200):
        tree = [tree]
    with pytest.raises(CodecError):
        decode(tree)


def test_encode_refuses_other_types():
    class Eq(int):
        def __eq__(self, other):
            return True
    for v in (Eq(1), object(), len, [Eq(2)]):
        with pytest.raises(CodecError):
            encode(v)


def test_module_names():
    assert module_names(["a.py", "pkg/__init__.py", "pkg/sub/m.py", "data.txt", "bad-name.py"]) == \
        ["a", "pkg", "pkg.sub.m"]


SRC = {
    "shapes.py": (
        "LIMIT = 3\n"
        "class Counter:\n"
        "    def __init__(self, start=0):\n        self.n = start\n"
        "    def add(self, k):\n        self.n += k\n        return self.n\n"
        "    def me(self):\n        return self\n"
        "def area(w, h):\n    return w * h\n"
        "def pair(x):\n    return (x, [x])\n"
        "def boom(x):\n    raise ValueError(f'bad {x}')\n"
        "class MyErr(Exception):\n    pass\n"
        "def custom():\n    raise MyErr('mine')\n"
        "def opaque():\n    return object()\n"
        "def loop():\n    while True:\n        pass\n"
        "def nap():\n    import time\n    time.sleep(30)\n"
        "def chatty():\n    print('x' * 100000)\n    return 1\n"
    ),
    "pkg/__init__.py": "",
    "pkg/deep.py": "def twice(x):\n    return 2 * x\n",
}
TESTS = """import pytest
import shapes
from shapes import Counter, area, pair
from pkg.deep import twice
from pkg import deep


def test_values():
    assert area(2, 3) == 6 and type(area(2.0, 3)) is float
    assert pair(4) == (4, [4]) and type(pair(4)) is tuple
    assert shapes.LIMIT == 3
    assert twice(4) == 8 and deep.twice(1) == 2


def test_handles():
    c = Counter(5)
    c.add(2)
    assert c.add(1) == 8 and c.n == 8
    assert c.me() != c  # a handle is never equal to anything
    with pytest.raises(TypeError):
        bool(c)


def test_builtin_exception():
    with pytest.raises(ValueError, match="bad 3"):
        shapes.boom(3)


def test_custom_exception():
    shapes.custom()


def test_opaque():
    shapes.opaque()


def test_chatty():
    assert shapes.chatty() == 1


def test_loop():
    shapes.loop()


def test_after_loop():
    assert area(1, 1) == 1
"""


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=1, timeout_s=20) as s:
        yield s


def _ws(tmp_path, files):
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(tmp_path, rel)) or str(tmp_path), exist_ok=True)
        (tmp_path / rel).write_text(text)
    return str(tmp_path)


def outcomes(res):
    return {r["id"].split("::")[1]: (r["outcome"], r["message"]) for r in res.tests if r["event"] == "test"}


def test_hidden_tests_reach_the_code_only_as_plain_data(sb, tmp_path):
    res = sb.judge(_ws(tmp_path, SRC), ["-q", "-p", "no:cacheprovider", "tests/test_h.py"],
                   {"tests/test_h.py": TESTS}, module_names(SRC), test_timeout_s=0.5)
    got = outcomes(res)
    assert res.error is None, res.error
    for name in ("test_values", "test_handles", "test_builtin_exception", "test_chatty"):
        assert got[name][0] == "passed", got[name]
    assert got["test_custom_exception"][0] == "failed" and "MyErr: mine" in got["test_custom_exception"][1]
    assert got["test_opaque"][0] == "failed" and "not plain data" in got["test_opaque"][1]
    assert got["test_loop"][0] == "failed" and "timed out" in got["test_loop"][1]
    assert got["test_after_loop"][0] == "passed"  # a CPU-bound loop fails alone
    assert "x" * 1000 in res.stdout  # the child's output is kept (for the log), truncated
    assert res.judge_calls > 10


def test_a_missed_answer_kills_the_child_and_fails_the_rest(sb, tmp_path):
    tests = "from shapes import nap, area\n\ndef test_a():\n    nap()\n\ndef test_b():\n    assert area(1, 1) == 1\n"
    res = sb.judge(_ws(tmp_path, SRC), ["-q", "tests/test_n.py"], {"tests/test_n.py": tests},
                   module_names(SRC), test_timeout_s=0.2, call_wall_s=1.0)
    got = outcomes(res)
    assert got["test_a"][0] == "failed" and "no answer" in got["test_a"][1]
    assert got["test_b"][0] == "failed"
    assert res.duration_s < 10
