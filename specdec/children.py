"""Child processes that end with the process that started them.

A local stack (`specdec up`, `specdec generate` without --address, bench, soak, the tests)
is a redis-server and three service processes started by one Python process. That process
stops them on its way out, Ctrl-C, SIGTERM and SIGHUP included (launcher.Stack); killed
outright instead (SIGKILL, the kernel's out-of-memory killer, a crash in native code) it
used to leave them running: the next `specdec up` then found its ports taken, and each
model service kept its memory.

`ending_with_parent(command)` is `command` run through a few lines of Python (EXEC_SHIM)
that ask the kernel to send the child SIGTERM when its parent ends (Linux's
PR_SET_PDEATHSIG, which survives the exec), then exec the command itself, in the same
process: its pid, signals and exit status are the command's. A service takes that SIGTERM
as any stop (it drains, then exits); redis-server exits. Elsewhere than Linux the command
runs as it would have, without that guard.

The kernel sends the signal when the *thread* that started the child ends, not only the
process: start children from a thread that lives as long as they should (every caller here
starts them from its main thread).

`start_child` starts one so, in a session of its own: a terminal's Ctrl-C goes to its
foreground process group, which held the children too, so each stopped at once as the parent
began its ordered stop (the coordinators first, draining their requests, then the model
services and Redis): streams in flight ended UNAVAILABLE and the coordinator could not record
how its sessions ended, Redis gone. Now only the parent gets it, and stops them in order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

# Run with `python -S -c` (no site, stdlib only: ~10 ms) as: EXEC_SHIM PARENT_PID COMMAND...
EXEC_SHIM = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
except (OSError, AttributeError, TypeError):  # no prctl (not Linux): the command outlives a killed parent
    pass
if os.getppid() != int(sys.argv[1]):  # the parent ended before the line above: so does the child
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def ending_with_parent(command: Sequence[str], parent_pid: int) -> list[str]:
    """`command` (program and arguments) as a command line that runs it, in the process
    Popen starts, so that it receives SIGTERM when `parent_pid` (the caller: os.getpid()),
    or rather the thread that starts it, ends (module doc)."""
    return [sys.executable, "-S", "-c", EXEC_SHIM, str(parent_pid), *command]


def start_child(command: Sequence[str], **popen) -> subprocess.Popen:
    """Popen of `command`, ending with this process (ending_with_parent) and in a session of
    its own, out of reach of a terminal's Ctrl-C (module doc); `popen`: Popen's other arguments."""
    return subprocess.Popen(ending_with_parent(command, os.getpid()), start_new_session=True, **popen)
