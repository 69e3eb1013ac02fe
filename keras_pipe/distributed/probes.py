"""Whether a worker answers: gRPC probes and what a TCP connect shows.

A TCP connect alone does not tell a live worker from a stopped one (the
kernel accepts connections for a stopped process), and a gRPC deadline
that passes does not tell a hung worker from a busy one. These probes are
what `keras_pipe.distributed.cluster` builds its rules on: `connect` waits
for every task to answer, the watchdog of `cluster.run` probes each task
once a second (`KeptProbe`), and after an error a task counts as gone
only if it takes no TCP connection (`gone`).
"""

import socket
import threading
import time

__all__ = ["KeptProbe", "gone", "probe", "tcp_state", "unreachable",
           "why_down"]


def probe(address, timeout=1.0):
    """Whether a gRPC server answers at `address` within `timeout` seconds.

    A TCP connect alone is not enough: the kernel accepts connections for
    a stopped (hung) process. This waits for the HTTP/2 handshake.
    """
    import grpc  # A TensorFlow dependency.

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


# No server implements it: a live gRPC server answers UNIMPLEMENTED at once.
_PING = "/keras_pipe.Watch/Ping"


class KeptProbe:
    """`probe` over one kept channel per address: cheap enough to repeat.

    A new channel per probe costs the client and the worker a TCP connect,
    an HTTP/2 handshake and grpc's own polling thread: once a second per
    worker, a noticeable share of a busy client's CPU next to the stages
    it shares cores with. Here each probe is one call of a method no
    server implements on a channel kept open: a live server answers
    UNIMPLEMENTED (a small fraction of a new channel's cost), a stopped
    (hung) one lets the deadline pass, a dead one fails to connect.
    After a failure the channel is dropped, so the next probe connects
    afresh instead of waiting out grpc's reconnection backoff.

    A deadline that passes does not tell a hung worker from a busy one: a
    worker pinned to one core of a loaded host can miss several probes in
    a row while it trains. So `_Watch` gives a silent task `silence`
    seconds, and a refused one `misses` probes.
    """

    def __init__(self):
        self.channels = {}

    def __call__(self, address, timeout):
        """`"ok"` (it answered), `"silent"` (no answer within `timeout`:
        stopped, or too busy on a loaded host) or `"down"` (no server:
        the connection failed)."""
        import grpc  # A TensorFlow dependency.

        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = grpc.insecure_channel(address)
        try:
            channel.unary_unary(_PING)(b"", timeout=timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "ok"
            self.channels.pop(address).close()
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "silent"
            return "down"
        return "ok"

    def close(self):
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()


def unreachable(tasks, timeout):
    """The subset of `tasks` that does not answer before `timeout` seconds."""
    deadline = time.monotonic() + timeout
    pending = dict(tasks)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        results = {}
        threads = [threading.Thread(
            # The threads are joined inside this iteration.
            target=lambda n=name, a=address: results.__setitem__(  # noqa: B023
                n, probe(a, min(left, 1.0))), daemon=True)  # noqa: B023
            for name, address in pending.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        pending = {n: a for n, a in pending.items() if not results.get(n)}
        if pending:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return pending


def tcp_state(address):
    """`"accepts"` (the kernel takes a TCP connection: the process lives,
    perhaps stopped or busy), `"refused"` (nothing listens) or another
    reason a connection could not be made."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=1.0):
            return "accepts"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError) as exc:
        return f"no connection: {exc}"


def gone(tasks):
    """The subset of `tasks` that takes no TCP connection: its process (or
    host) is gone. A live worker too busy to answer a gRPC probe in time
    (one pinned core of a loaded host) still accepts a connection: it is
    not gone, and the error of the call it ran is the one to report."""
    return {n: a for n, a in tasks.items() if tcp_state(a) != "accepts"}


_TCP_MEANING = {
    "accepts": "accepts TCP connections but gives no gRPC answer: hung, or "
               "not a TF server",
    "refused": "connection refused: nothing listens on that port"}


def why_down(tasks):
    """What a TCP connect to each task shows, e.g. 'task:1: connection refused'."""
    reasons = []
    for name, address in tasks.items():
        state = tcp_state(address)
        reasons.append(f"{name.rsplit('/', 1)[-1]}: "
                       f"{_TCP_MEANING.get(state, state)}")
    return "; ".join(reasons)
