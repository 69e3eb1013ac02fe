"""Keeping TensorFlow's gRPC server on one address, in workers and clients.

TF's gRPC server listens on `0.0.0.0:<port>` (every interface) whatever the
host in the cluster spec (hard-coded in TF's `grpc_server_lib.cc`); a worker
starts one, and so does a client in `keras_pipe.connect`. TF's gRPC runtime
has no authentication, so anyone reaching such a port runs code in the
process. `pin(host)` makes TF bind `host` instead: it loads a small C
library (`_bind.c`, compiled when keras_pipe is installed, never at run
time, and checked against the SHA-256 recorded at build time) that rewrites
the `bind` entries of TF's own shared objects (their GOT) to a bind() that
turns a wildcard address into `host`. Python's sockets and other libraries
are left alone. Unlike an `LD_PRELOAD` shim it needs no restart of the
process, so a worker imports TF once and a client pins itself inside
`connect`.

`listening_hosts(port)` reads `/proc/net/tcp{,6}` to check the result.
"""

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import ipaddress
import os
import pathlib
import socket
import stat
import struct
import sys

__all__ = ["WILDCARDS", "check_address", "format_address", "listening_hosts",
           "pin", "shim_path"]

# Addresses meaning "every interface".
WILDCARDS = ("0.0.0.0", "::")
_PACKAGE = pathlib.Path(__file__).parent
_LOADED = {}


def check_address(host, name="bind"):
    """Checks that `host` is an IP address of this machine (or a wildcard).

    Returns:
        The address as normalized text, e.g. `"127.0.0.1"` or `"::1"`.

    Raises:
        TypeError: if `host` is not a string.
        ValueError: if it is a host name, or no interface has the address.
    """
    if not isinstance(host, str):
        raise TypeError(f"{name} must be an IP address string such as "
                        f"'127.0.0.1'. Received: {name}={host!r}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{name} must be an IP address of this machine (e.g. "
            f"'127.0.0.1', or '0.0.0.0' for every interface), not a host "
            f"name. Received: {name}={host!r}") from None
    text = str(address)
    if text in WILDCARDS:
        return text
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((text, 0))
        except OSError as exc:
            raise ValueError(
                f"{name}={host!r} is not an address of this machine ({exc}). "
                "Pass one of its interface addresses, e.g. '127.0.0.1'."
            ) from None
    return text


def format_address(host, port):
    """`host:port`, with brackets for IPv6 (`[::1]:2222`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _decode_address(hex_address):
    """Decodes an address of /proc/net/tcp{,6} into text."""
    # The kernel prints the address as 32-bit words in host byte order.
    packed = b"".join(struct.pack("=I", int(hex_address[k:k + 8], 16))
                      for k in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(packed)
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def listening_sockets():
    """`[(host, port, inode)]` of every listening TCP socket (Linux)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A":  # LISTEN
                found.append((_decode_address(address), int(hex_port, 16),
                              int(fields[9])))
    return found


def listening_hosts(port):
    """The local addresses with a TCP socket listening on `port` (Linux).

    Returns:
        A sorted list such as `["127.0.0.1"]`; `"0.0.0.0"` or `"::"` for a
        wildcard listener. Empty where `/proc/net` is unavailable.
    """
    return sorted({h for h, p, _ in listening_sockets() if p == port})


def _sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _installed_shim():
    """The shim built by setup.py next to this module, else None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _PACKAGE / f"_bind{suffix}"
        if candidate.exists():
            return candidate
    return None


def shim_path():
    """The path of the bind shim, after checking its SHA-256.

    The shim is built when keras_pipe is installed (setup.py), next to
    this module, with its hash in `_bind.sha256`; nothing is compiled at
    run time.

    Raises:
        RuntimeError: if the platform is not Linux, the shim was not built
            (naming the command that builds it), its hash differs from the
            recorded one (the file was changed after the build), or the
            file is writable by others.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            "Keeping TF's gRPC server on one address needs Linux; this "
            f"platform is {sys.platform}.")
    path = _installed_shim()
    record = _PACKAGE / "_bind.sha256"
    if path is None or not record.exists():
        raise RuntimeError(
            "keras_pipe's bind shim (keras_pipe/distributed/_bind*.so and "
            f"its _bind.sha256, in {str(_PACKAGE)!r}) is not built: it is "
            "compiled when keras_pipe is installed. Reinstall keras_pipe "
            "(`pip install keras_pipe`, or `pip install -e .` in a source "
            "checkout; `python setup.py build_ext --inplace` builds only "
            "the shim).")
    expected = record.read_text().split()[0]
    actual = _sha256(path)
    if actual != expected:
        raise RuntimeError(
            f"The bind shim {str(path)!r} has SHA-256 {actual}, but "
            f"{str(record)!r} records {expected}: the file was changed after "
            "it was built. Reinstall keras_pipe (`pip install -e .` in a "
            "source checkout).")
    mode = os.stat(path).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"The bind shim {str(path)!r} is writable by other users "
            f"(mode {stat.filemode(mode)}); refusing to load it. Run "
            f"`chmod go-w {path}`.")
    return str(path)


def pin(host):
    """Makes TF's gRPC servers started from now on listen on `host` only.

    Call after TF's libraries are loaded (importing TensorFlow loads them)
    and before TF starts its server
    (`tf.distribute.Server`, `tf.config.experimental_connect_to_cluster`).
    A wildcard `host` (`"0.0.0.0"`, `"::"`) is a no-op.

    Returns:
        The number of `bind` call sites rewritten in TF's libraries.

    Raises:
        RuntimeError: if the shim cannot be loaded (see `shim_path`) or no
            TF library calls bind() through a rewritable entry.
    """
    host = check_address(host)
    if host in WILDCARDS:
        return 0
    # Only shared objects inside TF's package directory are rewritten; the
    # caller loaded them (`import tensorflow`, or a worker's
    # `keras_pipe.distributed.runtime.load()`, which imports no TF module).
    spec = importlib.util.find_spec("tensorflow")
    tf_dir = os.path.join(list(spec.submodule_search_locations)[0], "")

    path = shim_path()
    library = _LOADED.get(path)
    if library is None:
        library = ctypes.CDLL(path)
        library.keras_pipe_pin.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        library.keras_pipe_pin.restype = ctypes.c_int
        _LOADED[path] = library
    patched = library.keras_pipe_pin(host.encode(), tf_dir.encode())
    if patched <= 0:
        raise RuntimeError(
            f"Could not redirect TensorFlow's bind() calls to {host!r} "
            f"(result {patched}): TF's libraries have no rewritable bind "
            "entry in this build.")
    return patched
