"""The sandbox child's seccomp filter: syscalls no test needs get EPERM (HOST, Linux only).

Installed by `jail.enter_child` after the uid drop, with no-new-privileges set:

    seccomp_data.arch == this machine's audit arch ?  no -> allow (another ABI's numbers)
    x86_64 only: nr >= 0x40000000 (the x32 ABI)      -> EPERM
    nr in _BLOCKED                                   -> EPERM
    anything else                                    -> allow

Leaf module (ctypes only). Unknown machines get no filter; the other layers still hold.
"""
from __future__ import annotations

import ctypes
import platform
import struct

_libc = ctypes.CDLL(None, use_errno=True)

# Syscalls no test needs that would open a channel past the call or the kernel's soft spots:
# the kernel keyrings (a uid's user keyring outlives its processes and is not namespaced by
# IPC/PID namespaces), perf events and bpf (side channels), userfaultfd and io_uring.
_BLOCKED = ("add_key", "request_key", "keyctl", "perf_event_open", "bpf", "userfaultfd",
            "io_uring_setup")
_SYSCALLS = {  # audit arch -> syscall numbers, in the order of _BLOCKED
    "x86_64": (0xC000003E, (248, 249, 250, 298, 321, 323, 425)),
    "aarch64": (0xC00000B7, (217, 218, 219, 241, 280, 282, 425)),
}


def program() -> bytes | None:
    """The seccomp program (BPF, 8 bytes per instruction): EPERM for `_BLOCKED` and the
    x32 ABI, allow the rest; None on a machine whose syscall numbers are not listed."""
    arch = _SYSCALLS.get(platform.machine())
    if arch is None:
        return None
    audit, nrs = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    body = [(ld, 0, 0, 0)]  # seccomp_data.nr
    if audit == 0xC000003E:
        body.append((jge, 0, 0, 0x40000000))  # x32 syscalls: jt patched below
    body += [(jeq, 0, 0, nr) for nr in nrs]
    prog = [(ld, 0, 0, 4), (jeq, 0, len(body), audit)] + body + [(ret, 0, 0, allow), (ret, 0, 0, eperm)]
    errno_at = len(prog) - 1
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        if i >= 2 and code in (jeq, jge):
            jt = errno_at - i - 1
        out.append(struct.pack("HBBI", code, jt, jf, k))
    return b"".join(out)


# Built once, in the worker, so a child only pays for two prctl calls.
PROGRAM = program()


def install() -> bool:
    """Install `PROGRAM` for this process and its children (no new privileges)."""
    prog = PROGRAM
    if prog is None:
        return False
    buf = ctypes.create_string_buffer(prog)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return _libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER
