"""The project's own red team: each attack on verify / Sandbox / tools as a regression test.

Every test plays a hostile agent. Verify attacks put a cheat into `bsearch.py` (the buggy
task source, or code that returns a wrong answer unless the cheat works) and assert the
SECURE outcome: reward 0.0, and `verify` never raises. Where it can, a test first shows the
cheat is real: the same file run by a *naive grader* (a miniature of an in-process judge:
hidden tests in the same process as the code, a nonce-tagged report pipe, a tamper check;
run inside the sandbox) or by plain pytest on the hidden tests passes every hidden test,
so no test here can pass because its exploit is broken. Sandbox attacks (IPC, processes,
the trainer's environment, the filesystem, memory left over from earlier calls) use
`Sandbox.run` directly and assert the pool neither leaks nor degrades.

Some of these attacks succeed against an in-process judge by construction (frames, gc,
settrace, ctypes): they pass only once the hidden tests and every comparison run in a
process the code under test cannot reach, and only plain data crosses.
"""
