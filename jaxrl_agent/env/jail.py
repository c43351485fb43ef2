"""Low-level isolation primitives for sandbox workers (HOST, Linux only).

Everything here runs inside a sandbox worker process, never in the caller:

- `build_jail`: once per worker, enter a new mount + network namespace and build a root
  for untrusted children: a size-limited tmpfs holding read-only bind mounts of the system
  libraries and the Python installation, a few device nodes, a writable `/workspace` and
  `/tmp`. Nothing else of the host (home directories, the repository, other workspaces,
  `/proc`) exists in it. This is what bubblewrap does, done in-process because the worker
  must keep forking from an interpreter that has already imported pytest.
- `mount_call_dirs` / `release_call_dirs`: per call, a fresh tmpfs (size and inode caps) at
  the jail's `/workspace` and `/tmp`, lazily unmounted afterwards: cleanup never walks what
  a call wrote, so no tree (deep, huge, unwritable) can make it fail or hang;
  `unshare_call`: a fresh IPC and PID namespace for the call's processes.
- `enter_child`: in a freshly forked child, apply rlimits, chroot into the jail, drop to
  the worker's own unprivileged uid/gid, install the seccomp filter (`seccomp.py`).
- `kill_uid`: kill every process of a uid (the per-worker uid makes this exact), looping
  until none is left, so nothing an untrusted call started outlives it.
"""
from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time

from jaxrl_agent.env import seccomp

# ---- syscalls ----

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x40000000, 0x08000000, 0x20000000
MNT_DETACH = 2
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 32, 4096, 16384, 1 << 18)
PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 36, 1, 4

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


# ---- the jail ----

# Read-only system directories the interpreter and its C extensions need.
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
# Individual /etc files (not all of /etc: it holds host configuration the code has no use for).
_ETC_FILES = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "localtime",
              "hosts", "mime.types")
_DEV_NODES = ("null", "zero", "urandom", "random", "full")


def _python_dirs() -> list[str]:
    """Directories of the Python installation (prefixes and import path entries)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    import site
    for p in [*sys.path, *site.getsitepackages()]:
        if p and os.path.isdir(p) and ("site-packages" in p or "dist-packages" in p
                                       or p.startswith(sys.base_prefix)):
            dirs.add(p)
    return sorted(os.path.realpath(d) for d in dirs if os.path.isdir(d))


def _bind_ro(src: str, root: str, devices: bool = False) -> None:
    """Bind `src` read-only at the same path under `root` (files and directories).

    Device nodes keep working on a read-only bind (writing /dev/null is allowed), but only
    where `devices` is set; everywhere else the bind is nodev and nosuid.
    """
    target = root + src
    if os.path.ismount(target) or (os.path.exists(target) and not os.path.isdir(src)):
        return
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(src, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if devices else MS_NODEV)
    _mount(None, target, None, flags)


def build_jail(disk_mb: int, uid: int) -> str:
    """Enter new mount+net namespaces and build the jail root; returns its path.

    Raises OSError when the kernel or the container refuses (no CAP_SYS_ADMIN, seccomp);
    the caller then falls back to the weaker isolation documented in `sandbox`.
    """
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(mount+net)")
    # Mounts made from here on stay private to this worker.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = tempfile.mkdtemp(prefix="jxa-jail-")
    # The jail's root holds only mount points; what a call may write lives on the per-call
    # tmpfs mounts of `mount_call_dirs` (their size caps disk fill).
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):  # merged-/usr layouts: /bin -> usr/bin
            os.symlink(os.readlink(d), root + d)
        elif os.path.isdir(d):
            _bind_ro(d, root)
    for d in _python_dirs():
        if not _under_tmp(d):  # those are bound on each call's /tmp (mount_call_dirs)
            _bind_ro(d, root)
    for f in _ETC_FILES:
        if os.path.isfile("/etc/" + f):
            _bind_ro("/etc/" + f, root)
    os.makedirs(root + "/dev", exist_ok=True)
    for n in _DEV_NODES:
        if os.path.exists("/dev/" + n):
            _bind_ro("/dev/" + n, root, devices=True)
    # Writable places: the workspace copy (owned by the worker uid) and /tmp.
    os.makedirs(root + "/workspace", exist_ok=True)
    os.makedirs(root + "/tmp", exist_ok=True)
    _loopback_up()
    return root


def _under_tmp(path: str) -> bool:
    return path == "/tmp" or path.startswith("/tmp/")


def mount_call_dirs(root: str, disk_mb: int, uid: int, max_inodes: int) -> None:
    """Fresh tmpfs mounts at the jail's /workspace (owned by `uid`) and /tmp for one call.

    Each is capped at `disk_mb` MiB and `max_inodes` inodes (so millions of empty files
    cannot be made), and a Python installation that lives under /tmp (a venv made there)
    is bound read-only at its own path on the new /tmp, where the child expects it.
    """
    opts = f"size={int(disk_mb)}m,nr_inodes={int(max_inodes)}"
    _mount("tmpfs", root + "/workspace", "tmpfs", MS_NOSUID | MS_NODEV, opts + ",mode=755")
    os.chown(root + "/workspace", uid, uid)
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts + ",mode=1777")
    for d in _python_dirs():
        if _under_tmp(d) and d != "/tmp":
            _bind_ro(d, root)


def release_call_dirs(root: str) -> bool:
    """Detach the call's mounts (and what is bound under them); True when both went.

    A lazy unmount is O(1) whatever the tree holds; the kernel frees the tmpfs once the
    call's last process is gone.
    """
    ok = True
    for d in ("/tmp", "/workspace"):
        while os.path.ismount(root + d):
            if _libc.umount2((root + d).encode(), MNT_DETACH) != 0:
                ok = False
                break
    return ok


def unshare_call() -> None:
    """A new IPC namespace now and a new PID namespace for the next child: SysV queues,
    semaphores and shared memory a call makes die with it, and its processes see (and
    can signal) only each other; the first child forked is their init, and when it exits
    the kernel kills every process left in the namespace."""
    _check(_libc.unshare(CLONE_NEWIPC | CLONE_NEWPID), "unshare(ipc+pid)")


def _loopback_up() -> None:
    """Raise `lo` in the new network namespace (it has no other interface).

    Code that serves and connects on localhost then works; the host's network and the
    host's own loopback stay unreachable. Failure is ignored: a down `lo` is only stricter.
    """
    import fcntl
    import socket
    import struct
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sH", b"lo", 0)
            flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]  # SIOCGIFFLAGS
            fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
    except OSError:
        pass


# ---- per-call helpers ----


def clear_dir(path: str, budget_s: float = 10.0) -> bool:
    """Remove everything inside `path` (not `path` itself), whatever the permissions, the
    depth or the number of entries; False if it could not within `budget_s`.

    Iterative and flat: each directory's subdirectories are first renamed up to `path`
    itself, so no path is ever longer than two names below it (a 1500-deep tree cannot hit
    the recursion limit or PATH_MAX) and every entry is visited once.
    """
    deadline = time.monotonic() + budget_s
    moved, tag = 0, os.urandom(6).hex()  # names the tree cannot have made in advance
    try:
        while True:
            with os.scandir(path) as it:
                entries = list(it)
            if not entries:
                return True
            for e in entries:
                if time.monotonic() > deadline:
                    return False
                if not e.is_dir(follow_symlinks=False):
                    _unlink(e.path)
                    continue
                os.chmod(e.path, 0o700)
                with os.scandir(e.path) as it:
                    inner = list(it)
                for sub in inner:
                    if sub.is_dir(follow_symlinks=False):
                        moved += 1
                        os.rename(sub.path, os.path.join(path, f".jxa-clear-{tag}-{moved}"))
                    else:
                        _unlink(sub.path)
                try:
                    os.rmdir(e.path)
                except OSError:  # refilled meanwhile: the next round takes it
                    pass
    except OSError:
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except PermissionError:
        os.chmod(os.path.dirname(path), 0o700)
        os.unlink(path)


def copy_workspace(src: str, dst: str, uid: int | None, max_files: int = 2000) -> None:
    """Copy regular files and directories of `src` into `dst`, owned by `uid`.

    Symlinks, devices and sockets are skipped (a link could point outside the workspace);
    the copy is what the untrusted child may change, the caller's directory is never touched.
    """
    count = 0
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        rel = os.path.relpath(dirpath, src)
        target_dir = dst if rel == "." else os.path.join(dst, rel)
        if rel != ".":
            os.makedirs(target_dir, exist_ok=True)
            if uid is not None:
                os.chown(target_dir, uid, uid)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            s = os.path.join(dirpath, name)
            st = os.lstat(s)
            if not stat.S_ISREG(st.st_mode):
                continue
            count += 1
            if count > max_files:
                raise ValueError(f"workspace has more than {max_files} files")
            d = os.path.join(target_dir, name)
            shutil.copyfile(s, d)
            os.chmod(d, 0o644 | (st.st_mode & 0o111))
            if uid is not None:
                os.chown(d, uid, uid)


def enter_child(*, jail: str | None, workdir: str, uid: int | None, cpu_s: int,
                memory_mb: int, file_mb: int, max_procs: int, max_files: int) -> None:
    """In a freshly forked child: rlimits, chroot, drop privileges, cd to the workspace."""
    limits = [
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_FSIZE, file_mb * 2**20),
        (resource.RLIMIT_NOFILE, max_files),
        (resource.RLIMIT_CORE, 0),
    ]
    if uid is not None:  # RLIMIT_NPROC counts per real uid and is ignored for root
        limits.append((resource.RLIMIT_NPROC, max_procs))
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    if jail is not None:
        os.chroot(jail)
    os.chdir(workdir)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # If the worker dies, the child dies with it (set after setuid, which clears it).
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    seccomp.install()  # best effort: a kernel without seccomp keeps the other layers


def uid_can_read(uid: int, path: str) -> bool:
    """Whether `uid` (dropped to in a forked helper) can list `path`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.listdir(path)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _live_processes(field: bytes, value: int) -> list[int]:
    """Live (non-zombie) pids whose /proc status line `field` starts with `value`."""
    found, key = [], b"\n" + field + b":"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:  # exited meanwhile
            continue
        i = status.find(key)
        if i < 0 or b"\nState:\tZ" in status:
            continue
        if int(status[i + len(key): status.find(b"\n", i + 1)].split()[0]) == value:
            found.append(int(name))
    return found


def uid_processes(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is `uid`, from /proc."""
    return _live_processes(b"Uid", uid)


def _kill_until_gone(find, max_rounds: int) -> bool:
    """SIGKILL whatever `find()` lists, in rounds, until a scan finds nothing."""
    for _ in range(max_rounds):
        pids = find()
        if not pids:
            reap_zombies()
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)  # let SIGKILL land
        reap_zombies()
    return False


def kill_uid(uid: int, max_rounds: int = 500) -> bool:
    """SIGKILL every process whose real uid is `uid`; True once none is left.

    The per-worker uid makes this exact: only that worker's untrusted calls run as it, so
    grandchildren that called setsid() or double-forked are found too. Rounds repeat until a
    scan of /proc finds none, which wins the race against a fork bomb (a killed process
    cannot fork again, and RLIMIT_NPROC bounds how many there are). Zombies re-parented to
    this worker (a child subreaper) are reaped in between.
    """
    return _kill_until_gone(lambda: uid_processes(uid), max_rounds)


def kill_descendants(max_rounds: int = 500) -> bool:
    """Kill every descendant of this process (used when there is no per-call uid).

    This worker is a child subreaper, so every process a call left behind is either its
    child or a descendant of one; killing the children re-parents the grandchildren here,
    and rounds repeat until no child is left.
    """
    me = os.getpid()
    return _kill_until_gone(lambda: _live_processes(b"PPid", me), max_rounds)


def reap_zombies() -> None:
    """Collect exited children re-parented to this worker (it is a child subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
