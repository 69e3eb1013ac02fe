"""Fresh Python processes forked from a warm one, for the tests' child scripts.

A test that runs a script in a fresh process (it creates its own logical
devices, or connects to workers, before TensorFlow starts) paid for
importing TensorFlow, Keras and keras_pipe in every process: seconds of CPU
each. Here a warm process imports them once (importing starts no
TensorFlow runtime) and forks a child per script: the child has a fresh
runtime, fresh Keras state, its own working directory and arguments, and
runs the script as `python` would (`__main__`, the script's folder first on
`sys.path`, its exit code, the interpreter's own exit). There is one warm
process per environment a test passes (the environment is read at import).
A script whose environment must differ before the imports (an allocator,
a preloaded library) runs with `subprocess` as before.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

ZYGOTE = textwrap.dedent('''
    import json, os, runpy, sys
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras, numpy, tensorflow, keras_pipe  # noqa: F401
    print("READY", flush=True)
    for line in sys.stdin:
        argv, cwd, out, err = json.loads(line)
        pid = os.fork()
        if pid == 0:
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, out, os.O_WRONLY | os.O_CREAT),
                                    (2, err, os.O_WRONLY | os.O_CREAT)):
                opened = os.open(path, flags)
                os.dup2(opened, fd)
                os.close(opened)
            os.chdir(cwd)
            if argv[0] == "-c":
                sys.argv, sys.path[0] = argv[:1] + argv[2:], ""
                exec(compile(argv[1], "<string>", "exec"),
                     {"__name__": "__main__", "__builtins__": __builtins__})
            elif argv[0] == "-m":
                sys.argv, sys.path[0] = argv[1:], os.getcwd()
                runpy.run_module(argv[1], run_name="__main__",
                                 alter_sys=True)
            else:
                sys.argv = argv
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
''')

_WARM = {}  # environment items -> the warm process for that environment


def env():
    """The tests' environment for a child: TF quiet, this tree's keras_pipe,
    no TF_CONFIG, nothing preloaded."""
    result = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                  KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    for name in ("TF_CONFIG", "LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):
        result.pop(name, None)
    return result


def run(argv, env, cwd=ROOT, timeout=900):
    """`subprocess.run([sys.executable, *argv], ...)` in a forked child.

    `argv` is `[script, *args]`, `["-c", code, *args]` or
    `["-m", module, *args]`. Returns a `subprocess.CompletedProcess` with
    the child's exit code and its stdout and stderr as text.
    """
    key = tuple(sorted(env.items()))
    proc = _WARM.get(key)
    if proc is None or proc.poll() is not None:
        proc = _WARM[key] = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        atexit.register(proc.stdin.close)
        assert _answer(proc, timeout) == "READY"
    with tempfile.TemporaryDirectory() as folder:
        out, err = (os.path.join(folder, name) for name in ("out", "err"))
        proc.stdin.write(json.dumps([list(argv), str(cwd), out, err]) + "\n")
        proc.stdin.flush()
        code = int(_answer(proc, timeout))
        texts = []
        for path in (out, err):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return subprocess.CompletedProcess([sys.executable, *argv], code, *texts)


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
