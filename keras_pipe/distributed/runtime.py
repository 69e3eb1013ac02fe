"""TensorFlow's C++ runtime without its Python package: a worker's server.

A worker serves a client's ops and functions; everything it runs is in
TF's C++ libraries (`libtensorflow_framework.so.2`, `libtensorflow_cc.so.2`).
`import tensorflow` loads those and, on top, TF's Python package (thousands
of modules, keras among them, with their pybind extensions and the C++
state they register), which nearly doubles what an idle worker holds
resident (`docs/capacity.md` has the figures).

So a worker loads the libraries with `ctypes` (`load`), encodes its
`tensorflow.ServerDef` itself (`server_def`: a few fields of protobuf's
wire format) and starts TF's gRPC server through TF's C API
(`TF_NewServer`, `TF_ServerStart`, `TF_ServerJoin`): the same server
`tf.distribute.Server` starts, from the same bytes.
"""

import ctypes
import importlib.util
import os

__all__ = ["Server", "library_dir", "load", "server_def"]

_LIBRARIES = ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2")
_LOADED = []


def library_dir():
    """The directory of the installed `tensorflow` package (not imported)."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("TensorFlow is not installed; a worker needs it "
                           "(pip install tensorflow).")
    return os.path.join(list(spec.submodule_search_locations)[0], "")


def load():
    """Loads TF's C++ libraries into this process (once); returns the one
    with the C API (`libtensorflow_cc.so.2`)."""
    if not _LOADED:
        directory = library_dir()
        for name in _LIBRARIES:
            _LOADED.append(ctypes.CDLL(os.path.join(directory, name),
                                       mode=ctypes.RTLD_GLOBAL))
        library = _LOADED[-1]
        for name, argtypes, restype in (
                ("TF_NewStatus", [], ctypes.c_void_p),
                ("TF_DeleteStatus", [ctypes.c_void_p], None),
                ("TF_GetCode", [ctypes.c_void_p], ctypes.c_int),
                ("TF_Message", [ctypes.c_void_p], ctypes.c_char_p),
                ("TF_NewServer", [ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.c_void_p], ctypes.c_void_p),
                ("TF_ServerStart", [ctypes.c_void_p, ctypes.c_void_p], None),
                ("TF_ServerJoin", [ctypes.c_void_p, ctypes.c_void_p], None),
                ("TF_ServerTarget", [ctypes.c_void_p], ctypes.c_char_p)):
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, restype
    return _LOADED[-1]


def _varint(n):
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int_field(number, value):
    return _varint(number << 3) + _varint(value)


def _bytes_field(number, data):
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def server_def(tasks, job, task, intra_op_threads=None,
               inter_op_threads=None, thread_spinning=True):
    """A serialized `tensorflow.ServerDef` (protocol "grpc").

    Args:
        tasks: the cluster, `{job: {task index: "host:port"}}`.
        job: this task's job.
        task: this task's index in `job`.
        intra_op_threads: the sessions' intra-op pool, or `None` (TF's).
        inter_op_threads: the sessions' inter-op pool, or `None` (TF's).
        thread_spinning: whether idle threads of TF's pools spin before
            they sleep (TF's default); `False` sets the config's
            `experimental.disable_thread_spinning`.

    Returns:
        Bytes that parse as the `tf.train.ServerDef` that
        `tf.distribute.Server` makes of the same arguments
        (`tests/test_runtime.py` checks it).
    """
    # ServerDef: cluster = 1, job_name = 2, task_index = 3,
    # default_session_config = 4, protocol = 5. ClusterDef: job = 1.
    # JobDef: name = 1, tasks = 2 (map<int32, string>: key 1, value 2).
    # ConfigProto: intra_op_parallelism_threads = 2, inter_op_... = 5,
    # experimental = 16 (Experimental: disable_thread_spinning = 9).
    cluster = b"".join(
        _bytes_field(1, _bytes_field(1, name.encode()) + b"".join(
            _bytes_field(2, _int_field(1, index)
                         + _bytes_field(2, address.encode()))
            for index, address in sorted(tasks[name].items())))
        for name in sorted(tasks))
    config = b""
    if intra_op_threads is not None:
        config += _int_field(2, intra_op_threads)
    if inter_op_threads is not None:
        config += _int_field(5, inter_op_threads)
    if not thread_spinning:
        config += _bytes_field(16, _int_field(9, 1))
    return (_bytes_field(1, cluster) + _bytes_field(2, job.encode())
            + (_int_field(3, task) if task else b"")
            + _bytes_field(4, config)
            + _bytes_field(5, b"grpc"))


class Server:
    """TF's gRPC server of one task, through TF's C API.

    Args:
        definition: a serialized `ServerDef` (see `server_def`).
    """

    def __init__(self, definition):
        self._library = load()
        self._server = self._call("TF_NewServer", definition,
                                  len(definition))

    def _call(self, name, *args):
        status = self._library.TF_NewStatus()
        try:
            result = getattr(self._library, name)(*args, status)
            if self._library.TF_GetCode(status):
                message = self._library.TF_Message(status).decode(
                    errors="replace")
                raise RuntimeError(f"{name}: {message}")
            return result
        finally:
            self._library.TF_DeleteStatus(status)

    @property
    def target(self):
        """The server's target, e.g. `"grpc://127.0.0.1:2222"`."""
        return self._library.TF_ServerTarget(self._server).decode()

    def start(self):
        self._call("TF_ServerStart", self._server)

    def join(self):
        """Blocks until the server ends (it never does: kill the process)."""
        self._call("TF_ServerJoin", self._server)
