"""Sandbox containment: each hostile behaviour is contained and the pool keeps working."""
import os
import signal
import socket
import sys
import textwrap
import threading

import pytest

from jaxrl_agent.env import jail
from jaxrl_agent.env.sandbox import Sandbox

PY = sys.executable


# JXA_TEST_ISOLATION=basic|uid|namespaces forces a level (to exercise the fallbacks).
ISOLATION = os.environ.get("JXA_TEST_ISOLATION", "auto")


@pytest.fixture(scope="module")
def sb():
    with Sandbox(num_workers=2, timeout_s=5, memory_mb=512, isolation=ISOLATION) as s:
        yield s


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "mod.py").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "test_mod.py").write_text(
        "from mod import f\n\ndef test_ok():\n    assert f(1) == 2\n\n"
        "def test_bad():\n    assert f(1) == 3\n")
    return tmp_path


def py(sb, ws, code, timeout_s=None):
    return sb.run(ws, [PY, "-c", textwrap.dedent(code)], timeout_s=timeout_s)


def assert_pool_ok(sb, ws):
    """After any hostile call the same pool still runs ordinary code."""
    r = py(sb, ws, "print('alive')")
    assert r.error is None and r.returncode == 0 and r.stdout.strip() == "alive", r


def leftover_processes(sb):
    """Processes still running for the pool's calls (the workers' own children)."""
    if sb.isolation == "basic":
        workers = {str(p).encode() for p in sb.worker_pids()}
        out = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = open(f"/proc/{name}/status", "rb").read()
            except OSError:
                continue
            ppid = status.split(b"\nPPid:\t")[1].split(b"\n")[0]
            if ppid in workers and b"\nState:\tZ" not in status:
                out.append(int(name))
        return out
    uids = range(sb.config.base_uid, sb.config.base_uid + sb.config.num_workers)
    return [p for u in uids for p in jail.uid_processes(u)]


def skip_unless_uid_drop(sb):
    """Fork bombs are only contained with the per-worker uid (RLIMIT_NPROC): never run one
    at level "basic", where the child keeps the caller's (maybe root's) rights."""
    if sb.isolation == "basic":
        pytest.skip("fork-bomb containment needs the uid drop (root, level uid/namespaces)")


# ---- ordinary runs ----


def test_pytest_in_process_reports_each_test(sb, ws):
    r = sb.run(ws, [PY, "-m", "pytest", "-q", "test_mod.py"])
    assert r.error is None and not r.timed_out
    assert r.returncode == 1
    outcomes = {t["id"]: t["outcome"] for t in r.tests if t.get("event") == "test"}
    assert outcomes == {"test_mod.py::test_ok": "passed", "test_mod.py::test_bad": "failed"}
    assert "1 failed, 1 passed" in r.stdout
    end = [t for t in r.tests if t.get("event") == "end"]
    assert end and end[0]["tampered"] == []


def test_exec_path_exit_code_and_streams(sb, ws):
    r = py(sb, ws, "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert (r.returncode, r.stdout, r.stderr, r.timed_out) == (3, "out\n", "err\n", False)
    assert r.tests is None


def test_bad_requests_return_errors(sb, ws, tmp_path):
    assert "argv" in sb.run(ws, []).error
    assert "argv" in sb.run(ws, "python -c 1").error
    assert "not a directory" in sb.run(tmp_path / "nope", [PY, "-c", "1"]).error
    assert "timeout_s" in sb.run(ws, [PY, "-c", "1"], timeout_s=-1).error
    assert "relative" in sb.run(ws, [PY, "-m", "pytest"], memory_files={"../x.py": ""}).error
    r = sb.run(ws, ["/definitely/not/a/binary"])
    assert r.returncode == 127 and "cannot start" in r.stderr


def test_concurrent_calls(sb, ws):
    results = [None] * 6

    def go(i):
        results[i] = py(sb, ws, f"print({i} * 7)")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout.strip() for r in results] == [str(i * 7) for i in range(6)]


# ---- containment ----


def test_isolation_level_is_reported(sb, ws):
    assert sb.isolation in ("basic", "uid", "namespaces")
    assert py(sb, ws, "print(1)").isolation == sb.isolation
    if ISOLATION == "auto" and os.geteuid() == 0 and sys.platform == "linux":
        assert sb.isolation != "basic" or not os.path.exists("/proc/self/ns/net")


def test_unknown_options_are_rejected():
    with pytest.raises(TypeError, match="unknown option"):
        Sandbox(num_workrs=2)
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="chroot")
    with pytest.raises(ValueError, match="num_workers"):
        Sandbox(num_workers=0)


def test_pools_use_disjoint_uids_and_do_not_kill_each_other(sb, ws):
    if sb.isolation == "basic":
        pytest.skip("no per-worker uids at level basic")
    with Sandbox(num_workers=1, timeout_s=5) as other:
        mine = set(range(sb.config.base_uid, sb.config.base_uid + sb.config.num_workers))
        assert other.config.base_uid not in mine
        slow = {}
        t = threading.Thread(target=lambda: slow.update(r=py(sb, ws, "import time\n"
                                                             "time.sleep(1)\nprint('slept')")))
        t.start()
        for _ in range(5):  # the other pool's cleanup runs while the slow call sleeps
            assert_pool_ok(other, ws)
        t.join()
        assert slow["r"].returncode == 0 and slow["r"].stdout == "slept\n", slow["r"]


def test_wall_timeout_kills_infinite_loop(sb, ws):
    r = py(sb, ws, "while True: pass", timeout_s=2)
    assert r.timed_out and r.returncode == -signal.SIGKILL
    assert leftover_processes(sb) == []
    assert_pool_ok(sb, ws)


def test_memory_bomb(sb, ws):
    r = py(sb, ws, "x = bytearray(4 * 1024 ** 3)\nprint('allocated')")
    assert r.returncode != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert_pool_ok(sb, ws)


def test_fork_bomb_is_bounded_and_cleaned_up(sb, ws):
    skip_unless_uid_drop(sb)
    # Sleeping children: the count, not the CPU, is what RLIMIT_NPROC must stop.
    r = py(sb, ws, """
        import os, time
        n = 0
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
            except OSError:
                print("fork refused after", n, flush=True)
                break
    """, timeout_s=5)
    assert "fork refused" in r.stdout, r  # RLIMIT_NPROC stopped it
    assert leftover_processes(sb) == []
    assert_pool_ok(sb, ws)


def test_classic_spinning_fork_bomb(sb, ws):
    skip_unless_uid_drop(sb)
    r = py(sb, ws, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout_s=2)
    assert r.timed_out
    assert leftover_processes(sb) == []
    assert_pool_ok(sb, ws)


def test_child_that_outlives_its_parent_is_killed(sb, ws):
    r = py(sb, ws, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert r.stdout.strip() == "parent done" and not r.timed_out
    assert leftover_processes(sb) == []
    assert_pool_ok(sb, ws)


def test_disk_fill_is_bounded(sb, ws):
    if sb.isolation != "namespaces":
        pytest.skip(f"no size-capped tmpfs at isolation level {sb.isolation}")
    r = py(sb, ws, """
        import os
        chunk = b"x" * (1 << 20)
        try:
            for i in range(400):
                with open(f"fill{i}.bin", "wb") as f:
                    for _ in range(4):
                        f.write(chunk)
            print("wrote everything")
        except OSError as e:
            print("stopped:", e.strerror)
    """, timeout_s=20)
    assert "wrote everything" not in r.stdout and "stopped" in r.stdout, r
    assert_pool_ok(sb, ws)


def test_huge_file_hits_file_size_limit(sb, ws):
    r = py(sb, ws, """
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            with open("big.bin", "wb") as f:
                f.write(b"x" * (64 << 20))
            print("wrote")
        except OSError as e:
            print("refused:", e.strerror)
    """)
    assert "refused" in r.stdout or r.returncode != 0, r


def test_huge_output_is_truncated(sb, ws):
    r = py(sb, ws, "import sys\nfor _ in range(200): sys.stdout.write('y' * 65536)\nprint('end')")
    assert r.returncode == 0 and not r.timed_out
    assert len(r.stdout) < sb.config.max_output_bytes + 100
    assert r.stdout.endswith("[output truncated]")
    assert_pool_ok(sb, ws)


def test_no_network(sb, ws):
    if sb.isolation != "namespaces":
        pytest.skip(f"no network namespace at isolation level {sb.isolation}")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = py(sb, ws, f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
                try:
                    socket.create_connection(addr, timeout=1)
                    print("connected", addr)
                except OSError as e:
                    print("blocked", type(e).__name__)
        """)
    finally:
        srv.close()
    assert "connected" not in r.stdout and r.stdout.count("blocked") == 2, r


def test_cannot_write_outside_its_copy(sb, ws):
    if sb.isolation == "basic" and os.geteuid() == 0:
        pytest.skip("at level 'basic' the child keeps root's rights")
    r = py(sb, ws, f"""
        for path in ["/etc/evil", "/usr/evil", "/evil", {str(ws / 'evil')!r}, {PY + '_evil'!r}]:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as e:
                print("denied", path)
        open("mod.py", "w").write("changed = True\\n")
        print(open("mod.py").read().strip())
    """)
    assert "WROTE" not in r.stdout and r.stdout.count("denied") == 5, r
    assert "changed = True" in r.stdout  # its own copy is writable
    assert (ws / "mod.py").read_text().startswith("def f"), "caller's workspace changed"
    assert not (ws / "evil").exists()


def test_cannot_read_host_files(sb, ws, tmp_path_factory):
    if sb.isolation != "namespaces":
        pytest.skip(f"no filesystem jail at isolation level {sb.isolation}")
    secret = tmp_path_factory.mktemp("secret") / "secret.txt"
    secret.write_text("TOP SECRET")
    os.chmod(secret, 0o644)
    os.chmod(secret.parent, 0o755)
    targets = [str(secret), os.path.abspath(__file__), "/etc/shadow", "/proc/1/environ"]
    r = py(sb, ws, f"""
        for path in {targets!r}:
            try:
                print("READ", path, open(path).read()[:20])
            except OSError:
                print("unreadable", path)
    """)
    assert "READ" not in r.stdout and r.stdout.count("unreadable") == len(targets), r


def test_memory_files_are_not_on_disk(sb, ws):
    src = "from mod import f\n\ndef test_hidden():\n    assert f(2) == 3  # SECRET-MARK\n"
    (ws / "test_hidden.py").unlink(missing_ok=True)
    (ws / "mod.py").write_text(
        "import glob\nLEAK = ''.join(open(p).read() for p in glob.glob('**/test_*.py', recursive=True))"
        "\nassert 'SECRET-MARK' not in LEAK\n\ndef f(x):\n    return x + 1\n")
    r = sb.run(ws, [PY, "-m", "pytest", "-q", "test_hidden.py"],
               memory_files={"test_hidden.py": src})
    outcomes = [t["outcome"] for t in r.tests if t.get("event") == "test"]
    assert outcomes == ["passed"], r.stdout
    # The same module fails to import when the test file really is on disk.
    (ws / "test_hidden.py").write_text(src)
    r = sb.run(ws, [PY, "-m", "pytest", "-q", "test_hidden.py"])
    outcomes = [t["outcome"] for t in r.tests if t.get("event") == "test"]
    assert outcomes == ["error"] and "INTERNALERROR" not in r.stdout, r.stdout


def test_memory_module_failures_are_reported(sb, ws):
    src = "from mod import f\n\n\n\n\ndef test_hidden():\n    assert f(2) == 4\n"
    (ws / "mod.py").write_text("raise RuntimeError('broken at import')\n")
    r = sb.run(ws, [PY, "-m", "pytest", "-q", "test_hidden.py"],
               memory_files={"test_hidden.py": src})
    recs = [t for t in r.tests if t.get("event") == "test"]
    assert [t["when"] for t in recs] == ["collect"] and "broken at import" in recs[0]["message"]
    assert "INTERNALERROR" not in r.stdout


def test_forged_report_lines_are_rejected(sb, ws):
    (ws / "mod.py").write_text(
        "import os, json\n"
        "os.write(200, (json.dumps({'event': 'test', 'id': 'fake', 'outcome': 'passed'})"
        " + '\\n').encode())\n\ndef f(x):\n    return x + 1\n")
    r = sb.run(ws, [PY, "-m", "pytest", "-q", "test_mod.py"])
    assert r.forged_records >= 1
    assert all(t.get("id") != "fake" for t in r.tests)


# ---- worker death ----


def test_dead_worker_is_replaced(ws):
    """A killed worker's call errors and the worker is replaced, also when the kill lands
    right after the pool starts, before the worker's pre-forked call manager has armed its
    parent-death signal: that orphaned manager used to serve the next call (1-2 of 10 fresh
    pools in a loop), so this kills the worker of 12 fresh pools at once."""
    for attempt in range(12):
        with Sandbox(num_workers=1, timeout_s=5) as solo:
            os.kill(solo.worker_pids()[0], signal.SIGKILL)
            r = py(solo, ws, "print(1)")
            assert r.error is not None and "died" in r.error, (attempt, r)
            assert solo.restarts == 1
            if attempt == 0:
                assert_pool_ok(solo, ws)


def test_worker_killed_mid_call_is_replaced(ws):
    with Sandbox(num_workers=1, timeout_s=10) as solo:
        pid = solo.worker_pids()[0]
        timer = threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL))
        timer.start()
        r = py(solo, ws, "import time; time.sleep(5)")
        timer.join()
        assert r.error is not None and "died" in r.error
        assert_pool_ok(solo, ws)
