"""Fresh Python processes forked from a warm one, for the tests' child scripts.

A test that runs a script in a fresh process (it creates its own logical
devices, or connects to workers, before TensorFlow starts) paid for
importing TensorFlow, Keras and keras_pipe in every process: seconds of CPU
each. Here a warm process imports them once (importing starts no
TensorFlow runtime) and forks a child per script: the child has a fresh
runtime, fresh Keras state, its own working directory and arguments, and
runs the script as `python` would (`__main__`, the script's folder first on
`sys.path`, its exit code; at its end its threads are joined, its atexit
functions run and its output flushed, but the interpreter is not torn down:
that would collect the whole heap inherited from the warm process, more
than a second per child, for nothing a script can see). There is one warm
process per environment a test passes (the environment is read at import).
A script whose environment must differ before the imports (an allocator,
a preloaded library) runs with `subprocess` as before. `run` waits for the
child; `start` returns a `Child` that the test talks to as it runs (lines
of its stdout, a line on its stdin).
"""

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Python's cyclic collector at its default thresholds walks a test
# process's whole heap (every traced graph it keeps) thousands of times a
# run; collecting less often frees the same cycles, later. The test
# processes (tests/conftest.py) and the warm processes here use these.
GC_THRESHOLDS = (20000, 50, 100)

ZYGOTE = textwrap.dedent('''
    import atexit, gc, json, os, runpy, sys, threading
    gc.set_threshold(*GC_THRESHOLDS)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras, numpy, tensorflow, keras_pipe  # noqa: F401
    print("READY", flush=True)
    for line in sys.stdin:
        argv, cwd, out, err, given = json.loads(line)
        pid = os.fork()
        if pid == 0:
            for fd, path, flags in ((0, given or os.devnull, os.O_RDONLY),
                                    (1, out, os.O_WRONLY | os.O_CREAT),
                                    (2, err, os.O_WRONLY | os.O_CREAT)):
                opened = os.open(path, flags)
                os.dup2(opened, fd)
                os.close(opened)
            os.chdir(cwd)
            try:
                if argv[0] == "-c":
                    sys.argv, sys.path[0] = argv[:1] + argv[2:], ""
                    exec(compile(argv[1], "<string>", "exec"),
                         {"__name__": "__main__",
                          "__builtins__": __builtins__})
                elif argv[0] == "-m":
                    sys.argv, sys.path[0] = argv[1:], os.getcwd()
                    runpy.run_module(argv[1], run_name="__main__",
                                     alter_sys=True)
                else:
                    sys.argv = argv
                    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                    runpy.run_path(argv[0], run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code
            # Any other exception ends the child as `python` would (its
            # traceback, its exit status). Otherwise: what `python` does at
            # exit (wait for the threads, run the atexit functions, flush),
            # without tearing the interpreter down, which would walk the
            # whole heap inherited from the warm process.
            for thread in threading.enumerate():
                if thread is not threading.main_thread() \
                        and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)
        print(json.dumps(pid), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
''').replace("GC_THRESHOLDS", repr(GC_THRESHOLDS))

_WARM = {}  # environment items -> the warm process for that environment


def env():
    """The tests' environment for a child: TF quiet, this tree's keras_pipe,
    no TF_CONFIG, nothing preloaded."""
    result = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                  KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    for name in ("TF_CONFIG", "LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):
        result.pop(name, None)
    return result


def _zygote(env, timeout):
    """The warm process for `env`, started if there is none."""
    key = tuple(sorted(env.items()))
    proc = _WARM.get(key)
    if proc is None or proc.poll() is not None:
        proc = _WARM[key] = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        atexit.register(proc.stdin.close)
        assert _answer(proc, timeout) == "READY"
    return proc


def _fork(proc, argv, cwd, folder, stdin, timeout):
    """Sends one script to the warm process `proc`; the child's pid."""
    out, err = (os.path.join(folder, name) for name in ("out", "err"))
    proc.stdin.write(json.dumps([list(argv), str(cwd), out, err, stdin])
                     + "\n")
    proc.stdin.flush()
    return int(_answer(proc, timeout))


def _texts(folder):
    """The child's stdout and stderr ("" for a file not made yet)."""
    texts = []
    for name in ("out", "err"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8",
                      errors="replace") as f:
                texts.append(f.read())
        except FileNotFoundError:
            texts.append("")
    return texts


def run(argv, env, cwd=ROOT, timeout=900):
    """`subprocess.run([sys.executable, *argv], ...)` in a forked child.

    `argv` is `[script, *args]`, `["-c", code, *args]` or
    `["-m", module, *args]`. Returns a `subprocess.CompletedProcess` with
    the child's exit code and its stdout and stderr as text.
    """
    proc = _zygote(env, timeout)
    with tempfile.TemporaryDirectory() as folder:
        _fork(proc, argv, cwd, folder, None, timeout)
        code = int(_answer(proc, timeout))
        texts = _texts(folder)
    return subprocess.CompletedProcess([sys.executable, *argv], code, *texts)


def start(argv, env, cwd=ROOT, timeout=900):
    """A `Child` running `argv` (as in `run`) that reads its stdin from
    this process. Until it ends, no other script can run in its warm
    process."""
    return Child(_zygote(env, timeout), argv, cwd, timeout)


class Child:
    """A script forked from a warm process, its stdin a FIFO from here."""

    def __init__(self, proc, argv, cwd, timeout):
        self._proc = proc
        self._folder = tempfile.mkdtemp()
        fifo = os.path.join(self._folder, "in")
        os.mkfifo(fifo)
        self.pid = _fork(proc, argv, cwd, self._folder, fifo, timeout)
        self._stdin = open(fifo, "w")  # the child opens it first thing
        self._read = 0
        self.returncode = None

    def readline(self, timeout):
        """The child's next line of stdout ("" if it ended first)."""
        deadline = time.monotonic() + timeout
        path = os.path.join(self._folder, "out")
        while True:
            try:  # the child makes it after opening its stdin
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(self._read)
                    line = f.readline()
            except FileNotFoundError:
                line = ""
            if line.endswith("\n"):
                self._read += len(line.encode("utf-8"))
                return line
            if self._ended(0.0) or time.monotonic() > deadline:
                return line
            time.sleep(0.05)

    def communicate(self, text, timeout):
        """Writes `text` to the child's stdin, closes it, waits for the
        end; returns `(stdout, stderr)` (all of each)."""
        self._stdin.write(text)
        self._stdin.close()
        if not self._ended(timeout):
            self.kill()
            raise subprocess.TimeoutExpired(["warm child"], timeout)
        return tuple(_texts(self._folder))

    def stderr(self):
        return _texts(self._folder)[1]

    def kill(self):
        """SIGKILLs the child if it runs; waits for its end."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._ended(60.0)
        if not self._stdin.closed:
            self._stdin.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _ended(self, timeout):
        """Whether the child has ended (its exit code read), within
        `timeout` s."""
        if self.returncode is None and select.select(
                [self._proc.stdout], [], [], timeout)[0]:
            self.returncode = int(_answer(self._proc, 1.0))
        return self.returncode is not None


def _answer(proc, timeout):
    """The warm process' next line; kills it after `timeout` s."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise subprocess.TimeoutExpired(proc.args, timeout)
    line = proc.stdout.readline()
    assert line, "the warm process ended"
    return line.strip()
