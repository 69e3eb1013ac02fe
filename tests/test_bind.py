"""keras_pipe.distributed.bind: TF's gRPC port on one address; connect()
refuses otherwise."""

import socket

import pytest
from tensorflow.python.eager import context

import keras_pipe
from keras_pipe.distributed import bind as bind_lib
from keras_pipe.distributed import cluster as cluster_lib
from tests.support.ports import free_port

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


def test_pin_rewrites_tf_only_and_python_sockets_keep_their_address():
    assert bind_lib.pin("127.0.0.1") > 0  # TF's libraries call bind().
    assert bind_lib.pin("0.0.0.0") == 0  # The opt-in changes nothing.
    with socket.socket() as s:  # Python's own sockets are not touched.
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert bind_lib.listening_hosts(s.getsockname()[1]) == ["0.0.0.0"]


def test_addresses():
    assert bind_lib.check_address("127.0.0.1") == "127.0.0.1"
    assert bind_lib.check_address("0.0.0.0") == "0.0.0.0"
    assert bind_lib.format_address("::1", 2222) == "[::1]:2222"
    assert bind_lib.format_address("127.0.0.1", 2222) == "127.0.0.1:2222"


def test_a_missing_shim_is_an_error_naming_the_install(monkeypatch):
    # The shim is built at install only: nothing is compiled at run time.
    monkeypatch.setattr(bind_lib, "_installed_shim", lambda: None)
    with pytest.raises(RuntimeError, match=r"not built.*pip install -e \.") as e:
        bind_lib.shim_path()
    assert "_bind" in str(e.value)


def test_connect_refuses_to_listen_everywhere_and_says_how(monkeypatch):
    # Broke: connect() left the client's TF server on every interface.
    def no_shim(host):
        raise RuntimeError("no shim here.")

    monkeypatch.setattr(bind_lib, "pin", no_shim)
    monkeypatch.setattr(cluster_lib, "_unreachable", lambda tasks, t: {})
    with pytest.raises(RuntimeError) as info:
        keras_pipe.connect({"worker": ["127.0.0.1:1"]}, timeout=1.0)
    message = str(info.value)
    assert "listening on every interface" in message
    assert "no shim here." in message
    assert "keras_pipe.connect(..., bind='0.0.0.0')" in message
    assert context.get_server_def() is None  # Nothing was started.


def test_serve_from_python_listens_on_loopback_only():
    # Broke: serve() called from Python (no LD_PRELOAD shim) raised, but
    # only after TF had started listening on every interface.
    import os
    import pathlib
    import subprocess
    import sys

    port = free_port()
    script = (
        "import os\n"
        "from keras_pipe.distributed import bind, worker\n"
        f"worker.serve({{'worker': ['127.0.0.1:{port}']}}, task=0)\n"
        f"print(bind.listening_hosts({port}), flush=True)\n"
        "os._exit(0)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    for name in ("LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "['127.0.0.1']"
