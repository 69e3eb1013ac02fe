"""Why a worker process that this client started has ended (out of memory?).

A worker that runs out of memory dies: the kernel's out-of-memory killer
(or a cgroup limit) sends SIGKILL, or an allocation fails and the process
aborts (`std::bad_alloc`). The client only sees the connection close: TF
raises `UnavailableError: Socket closed`, naming no task. `local_workers`
started the process, so it can tell: it records each worker's process and
log here, and `keras_pipe.distributed.cluster` asks `why_ended` when a task
is lost, to name the cause (memory) next to the task and its stages.
A worker that `local_workers(..., restart=True)` starts again after it
ended is recorded too (`restarted`): its old process is then the one whose
end explains the loss. Nothing here imports TensorFlow.
"""

import re
import subprocess

__all__ = ["started", "stopped", "supervise", "is_supervised", "restarted",
           "recovered", "process", "why_ended"]

# task name ("/job:worker/replica:0/task:1") -> (Popen, log path)
_STARTED = {}
# task name -> (Popen, log path) of its process that ended and was replaced
_ENDED = {}
# tasks whose process is started again when it ends
_SUPERVISED = set()
_MEMORY = re.compile(r"bad_alloc|resource ?exhausted|out of memory|\bOOM\b|"
                     r"MemoryError|Cannot allocate memory", re.IGNORECASE)


def started(task, proc, log_path):
    """Records that this client started `task` as `proc`, logging to a file."""
    _STARTED[task] = (proc, log_path)


def stopped(task):
    """Forgets `task` (its process was stopped on purpose)."""
    _STARTED.pop(task, None)
    _ENDED.pop(task, None)
    _SUPERVISED.discard(task)


def supervise(task):
    """Records that a process of `task` that ends is started again."""
    _SUPERVISED.add(task)


def is_supervised(task):
    """Whether a process of `task` that ends is started again."""
    return task in _SUPERVISED


def restarted(task, proc, log_path):
    """Records that `proc` of `task` ended and a new process replaces it."""
    _ENDED[task] = (proc, log_path)


def recovered(task):
    """Forgets the ended process of `task`: the run went on without it."""
    _ENDED.pop(task, None)


def process(task):
    """The `subprocess.Popen` of `task` if this client started it, else None."""
    entry = _STARTED.get(task)
    return entry[0] if entry else None


def _log_lines(path):
    try:
        with open(path, errors="replace") as f:
            return [line.strip() for line in f.read()[-20000:].splitlines()
                    if line.strip()]
    except OSError:
        return []


def why_ended(task, wait=2.0):
    """Why the process of `task` ended, as a phrase; None if it runs on.

    Waits up to `wait` seconds for it to end (a lost connection is seen
    slightly before the exit). None too for a task this client did not
    start.
    """
    entry = _STARTED.get(task)
    if entry is None:
        return None
    proc, log_path = entry
    if task in _ENDED and proc.poll() is None:
        old, old_log = _ENDED[task]
        return (f"{_describe(old, old_log, old.returncode)}; it was started "
                f"again as pid {proc.pid}")
    try:
        code = proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        return None
    return _describe(proc, log_path, code)


def _describe(proc, log_path, code):
    """Why `proc`, which ended with `code`, ended, as a phrase."""
    lines = _log_lines(log_path)
    memory = [line for line in lines if _MEMORY.search(line)]
    if code == -9:
        return (f"its process (pid {proc.pid}) was killed by SIGKILL, the "
                "signal the kernel's out-of-memory killer (or a memory limit) "
                "sends: it most likely ran out of memory (`dmesg` shows "
                f"'Killed process {proc.pid}' if so)")
    if memory:
        return (f"its process (pid {proc.pid}) ran out of memory and exited "
                f"with code {code}: its log says {memory[-1][:300]!r}")
    tail = f"; its log ends: {lines[-1][:300]!r}" if lines else ""
    return f"its process (pid {proc.pid}) exited with code {code}{tail}"
