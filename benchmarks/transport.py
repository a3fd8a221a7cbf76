"""What moving one parameter-server step's bytes costs: gRPC against a plain TCP socket.

A parameter-server step sends the gradients (2.7 MB for the MLP 784-512-512-10 of
``parameter_server.py``) and gets the new values back in the reply. In one invocation,
on loopback, each transport echoes that many bytes between two processes:

(a) grpcio, a unary call of raw bytes (as keras_dist's tasks and the raw-gRPC baseline);
(b) a plain TCP socket: the bytes sent whole, read into a buffer (the floor of any
    transport over TCP; no framing, no authentication, no deadlines).

    python benchmarks/transport.py [--megabytes 2.7] [--calls 200] [--repeats 5]

Prints one line: milliseconds per round trip of each (medians) and their ratio.
"""

import argparse
import concurrent.futures
import multiprocessing
import socket
import statistics
import time

_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _grpc_echo_server(port, ready):
    import grpc  # (in the server's own process, started fresh by "spawn")

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), options=_OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("E", {"e": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def _read_exactly(connection, buffer):
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        count = connection.recv_into(view[got:])
        if count == 0:
            raise EOFError("the peer closed the connection")
        got += count


def _socket_echo_server(port, size, ready):
    listener = socket.create_server(("127.0.0.1", port))
    ready.set()
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(size)
    while True:
        _read_exactly(connection, buffer)
        connection.sendall(buffer)


def _serve(target, *args):
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=target, args=args + (ready,), daemon=True)
    process.start()
    if not ready.wait(60):
        raise RuntimeError("the echo server did not start")
    return process


def _milliseconds(call, calls):
    for _ in range(10):
        call()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return 1e3 * (time.perf_counter() - began) / calls


def main():
    # Here, not at the top: the "spawn" echo servers import this module and need neither.
    import grpc

    import keras_dist as kd

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=float, default=2.7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = int(args.megabytes * 1e6)
    payload = bytes(size)

    port = kd.testing.pick_unused_port()
    grpc_server = _serve(_grpc_echo_server, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS)
    echo = channel.unary_unary("/E/e")

    port = kd.testing.pick_unused_port()
    socket_server = _serve(_socket_echo_server, port, size)
    connection = socket.create_connection(("127.0.0.1", port))
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reply = bytearray(size)

    def socket_echo():
        connection.sendall(payload)
        _read_exactly(connection, reply)

    try:
        grpc_ms, socket_ms, ratios = [], [], []
        for _ in range(args.repeats):  # alternated, so that load falls on both
            grpc_ms.append(_milliseconds(lambda: echo(payload), args.calls))
            socket_ms.append(_milliseconds(socket_echo, args.calls))
            ratios.append(grpc_ms[-1] / socket_ms[-1])
    finally:
        grpc_server.kill()
        socket_server.kill()
    print(
        f"transport: a {args.megabytes:g} MB round trip takes {statistics.median(grpc_ms):.2f} ms "
        f"over gRPC vs {statistics.median(socket_ms):.2f} ms over a plain TCP socket, ratio "
        f"{statistics.median(ratios):.2f} [loopback, 2 processes, median of {args.repeats} x "
        f"{args.calls} calls]"
    )


if __name__ == "__main__":
    main()
