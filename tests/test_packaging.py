"""The wheel: it ships the compiled bind shim, and a worker starts from it."""

import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from keras_pipe.distributed import bind as bind_lib
from keras_pipe.distributed import cluster as cluster_lib
from tests.support.ports import free_port

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _start_worker(python, cwd, log):
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for name in ("PYTHONPATH", "LD_PRELOAD", "KERAS_PIPE_BIND_HOST",
                 "TF_CONFIG"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [python, "-m", "keras_pipe.distributed.worker", "--task", "0", "--cluster",
         address], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, address


def _see_running_packages(python):
    """Lets the venv at `python` import this interpreter's packages.

    `--system-site-packages` shows the system's site-packages only: when the
    tests themselves run in a virtual environment, TensorFlow is in that
    one. Its site directories go after the new venv's own (which holds the
    wheel), in a .pth file; the checkout (an editable install) is left out.
    """
    site_dirs = [p for p in sys.path
                 if os.path.basename(p) in ("site-packages", "dist-packages")]
    target = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(target, "_running_packages.pth"), "w",
              encoding="utf-8") as f:
        f.write("\n".join(site_dirs) + "\n")


@pytest.mark.slow
def test_wheel_ships_the_shim_and_starts_a_worker(tmp_path):
    # Broke: the wheel had no _bind.c and the worker died with
    # FileNotFoundError; the shim was compiled at first start and a cached
    # .so was trusted by its file name.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so",
        "_bind.sha256", ".pytest_cache", "runs", "benchmark_out"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)], check=True, capture_output=True, timeout=300)
    wheel, = (tmp_path / "dist").glob("keras_pipe-*.whl")
    names = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(wheel)], check=True,
        capture_output=True, text=True).stdout
    assert "keras_pipe/distributed/_bind.sha256" in names, names
    assert "keras_pipe/distributed/_bind.cpython-" in names, names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages",
                    str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    # Without PYTHONPATH: a checkout on it (with its keras_pipe.egg-info)
    # would satisfy the requirement, and pip would skip the wheel. The .pth
    # file comes after the install for the same reason.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300, env=clean)
    _see_running_packages(python)
    package = next((venv / "lib").glob("python*/site-packages/keras_pipe"))
    shim, = package.glob("distributed/_bind.cpython-*.so")

    with open(tmp_path / "worker.log", "w") as log:
        proc, address = _start_worker(python, tmp_path, log)
    try:
        deadline = time.monotonic() + 120
        while not cluster_lib.probe(address, 1.0):
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline
        port = int(address.rsplit(":", 1)[1])
        assert bind_lib.listening_hosts(port) == ["127.0.0.1"]
        out = (tmp_path / "worker.log").read_text()
        assert f"serving /job:worker/replica:0/task:0 on {address}" in out
    finally:
        proc.kill()
        proc.wait(timeout=30)

    # A shim changed after the build is refused, by its hash.
    with open(shim, "ab") as f:
        f.write(b"\0")
    with open(tmp_path / "tampered.log", "w") as log:
        proc, _ = _start_worker(python, tmp_path, log)
    assert proc.wait(timeout=120) == 1
    out = (tmp_path / "tampered.log").read_text()
    assert "keras_pipe.distributed.worker: The bind shim" in out, out
    assert "SHA-256" in out and "Reinstall keras_pipe" in out, out
