"""gRPC transport: one unary method carrying ``_wire`` messages, authenticated first.

``RpcServer`` serves one task at the address the cluster spec gives it (never
``0.0.0.0`` unless the spec says so). It checks the cluster token in the call's
metadata as the call arrives, before the request's body is read: a call without
it is refused (``UNAUTHENTICATED``) and logged, and the server never receives,
buffers or decodes what it sends (a stranger's 512 MiB cost it nothing). ``RpcClient``
calls one task with a deadline on every call, so no call can hang; a lost
task becomes ``kd.errors.UnavailableError`` naming it. A client made with
``retry_seconds`` (the ps tasks' clients: ``RECONNECT_SECONDS``) sends a call again
when its connection was lost (a link down for a few seconds), until the task
answers or it has been unreachable that long; a refused connection (nothing
listens: the task's process is gone) is not waited out. A request sent again may
have been applied already: the ps tasks answer a repeated ``update`` from its id.

grpcio's generic handlers pass the request through as bytes (no protobuf), so
arrays travel as raw buffers.
"""

import logging
import os
import threading
import time

import grpc

from keras_dist import errors
from keras_dist.parameter_server.rpc import _wire
from keras_dist.parameter_server.rpc._auth import TOKEN_METADATA_KEY
from keras_dist.parameter_server.rpc._auth import check_token
from keras_dist.parameter_server.rpc._auth import cluster_token
from keras_dist.parameter_server.rpc._auth import tls_channel_credentials
from keras_dist.parameter_server.rpc._auth import tls_server_credentials
from keras_dist.parameter_server.rpc._auth import token_from_environment
from keras_dist.parameter_server.rpc._threads import DaemonThreadPool

logger = logging.getLogger("keras_dist.ps")

SERVICE = "keras_dist.ps.Task"
METHOD = "Call"
DEFAULT_TIMEOUT = 60.0

# The largest request a task takes, in bytes (``KERAS_DIST_MAX_MESSAGE_BYTES``): a
# step's gradients or a variable's value travel whole, so the default is gRPC's
# own ceiling (2 GiB); lower it to bound what even an authenticated caller sends.
MAX_MESSAGE_ENV = "KERAS_DIST_MAX_MESSAGE_BYTES"
_GRPC_CEILING = 2**31 - 1


def max_message_bytes() -> int:
    """The request size cap of the servers this process starts (see ``MAX_MESSAGE_ENV``)."""
    text = os.environ.get(MAX_MESSAGE_ENV)
    if not text:
        return _GRPC_CEILING
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1024 <= value <= _GRPC_CEILING:
        raise ValueError(
            f"{MAX_MESSAGE_ENV} must be a number of bytes from 1024 to {_GRPC_CEILING}. "
            f"Received: {MAX_MESSAGE_ENV}={text!r}"
        )
    return value


_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # A restarted task comes back at the same address: reconnect quickly.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# A server must accept the clients' keepalive pings (its default takes a ping
# every 10 s as abuse and closes the connection with "too_many_pings").
_SERVER_OPTIONS = _OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]

# Errors a handler raises, sent back by name and raised again by the caller.
_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.CancelledError,
        errors.InvalidArgumentError,
        errors.NotFoundError,
        errors.FailedPreconditionError,
        errors.OutOfRangeError,
        errors.UnavailableError,
        errors.DeadlineExceededError,
    )
}


class RemoteError(errors.OpError):
    """An exception raised by a remote handler that has no ``kd.errors`` class.

    ``remote_type`` is its class name; the message is the remote traceback.
    """

    def __init__(self, message, remote_type="Exception"):
        super().__init__(message)
        self.remote_type = remote_type


def error_header(exc: BaseException) -> dict:
    """``exc`` as header fields that ``raise_if_error`` raises again on the caller's side."""
    name = type(exc).__name__
    if isinstance(exc, errors.OpError) and name in _ERRORS:
        return {"error": name, "message": exc.message, "tasks": list(exc.lost_tasks)}
    return {"error": "RemoteError", "message": f"{name}: {exc}", "type": name}


def _error_reply(exc: BaseException) -> bytes:
    return _wire.encode(error_header(exc))


def raise_if_error(header: dict) -> None:
    """Raises the error a handler sent back in ``header``, if it holds one."""
    name = header.get("error")
    if name is None:
        return
    if name in _ERRORS:
        raise _ERRORS[name](header["message"], header.get("tasks", ()))
    raise RemoteError(header["message"], header.get("type", "Exception"))


class RpcServer:
    """Serves ``handler(header, arrays, blob) -> (header, arrays, blob)`` at ``address``.

    The handler may also return an encoded message (``_wire.encode``).

    ``credentials`` (``grpc.ssl_server_credentials``) serves over TLS; use it
    whenever the network between tasks is not private. By default TLS comes
    from ``KERAS_DIST_TLS_CERT``/``KERAS_DIST_TLS_KEY`` when they are set.
    """

    def __init__(self, address: str, handler, *, name: str, credentials=None, threads: int = 16):
        self.address = address
        self.name = name
        self._handler = handler
        self._credentials = credentials if credentials is not None else tls_server_credentials()
        self._threads = threads
        self._server = None
        self.refused = 0  # requests refused for a missing or wrong token

    def start(self) -> None:
        """Binds ``address`` and starts serving."""
        executor = DaemonThreadPool(self._threads, f"kd-{self.name}")
        self.max_message_bytes = max_message_bytes()
        options = [o for o in _SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", self.max_message_bytes))
        server = grpc.server(executor, interceptors=(_TokenCheck(self),), options=options)
        method = grpc.unary_unary_rpc_method_handler(self._call)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {METHOD: method}),)
        )
        if self._credentials is not None:
            port = server.add_secure_port(self.address, self._credentials)
        else:
            port = server.add_insecure_port(self.address)
        if port == 0:
            raise RuntimeError(
                f"Could not serve {self.name} at {self.address}: the port is taken or the "
                "host is not an address of this machine. Fix the cluster spec. "
                f"Received: address={self.address!r}"
            )
        server.start()
        self._server = server

    def refuse(self, request_iterator, context) -> None:
        """Ends a call without the cluster token, its request never read (see ``_TokenCheck``)."""
        del request_iterator  # never iterated: the body is not received
        self.refused += 1
        logger.warning(
            "%s refused a request from %s without the cluster token "
            "(KERAS_DIST_CLUSTER_TOKEN); its body was not read.%s",
            self.name,
            context.peer(),
            ""
            if token_from_environment()
            else " This task has no KERAS_DIST_CLUSTER_TOKEN "
            "itself: set the same one on every task.",
        )
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{self.name} refused the request: it does not carry this cluster's token. "
            "Set the same KERAS_DIST_CLUSTER_TOKEN on every task.",
        )

    def _call(self, request: bytes, context) -> bytes:
        # Only calls that carried the token get here (``_TokenCheck``): nothing a
        # stranger sends is decoded, let alone unpickled.
        try:
            try:
                header, arrays, blob = _wire.decode(request)
            except Exception as exc:  # noqa: BLE001 - any decoding failure: a damaged message
                raise errors.InvalidArgumentError(
                    f"{self.name} received a request that is not a whole keras_dist message "
                    f"({len(request)} bytes): it was truncated or damaged on the way, or the "
                    f"caller is not a keras_dist task of this version. Received: {exc}"
                ) from None
            reply = self._handler(header, arrays, blob)
            # A handler may encode its reply itself (under its own lock, say).
            return reply if isinstance(reply, bytes) else _wire.encode(*reply)
        except Exception as exc:  # noqa: BLE001 - sent back to the caller, raised there
            if not isinstance(exc, errors.OpError):
                logger.debug("%s handler failed", self.name, exc_info=True)
            return _error_reply(exc)

    def stop(self, grace: "float | None" = None) -> None:
        """Stops serving; in-flight calls get ``grace`` seconds."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def wait(self, timeout: "float | None" = None) -> bool:
        """Blocks until the server stops (or ``timeout``); whether it stopped."""
        if self._server is None:
            return True
        return self._server.wait_for_termination(timeout)


class _TokenCheck(grpc.ServerInterceptor):
    """Checks the cluster token when a call arrives, from its metadata alone.

    A unary handler would get the request only once grpcio had received and
    assembled all of it. A call without the token is handed instead to a
    request-streaming handler that aborts without reading: the body is never
    taken off the connection, whatever its size.
    """

    def __init__(self, server: RpcServer):
        self._refusal = grpc.stream_unary_rpc_method_handler(server.refuse)

    def intercept_service(self, continuation, handler_call_details):
        if check_token(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        return self._refusal


_RECONNECT_GRACE_SECONDS = 1.5  # the longest reconnect backoff (1 s), jitter and margin

# How long a ps task's client keeps reconnecting to a task it lost the connection
# to (a link down, a stalled network: gRPC drops a connection silent for ~5 s)
# before the call raises ``UnavailableError``. A ps task unreachable for good is
# named this long after its connection was dropped.
RECONNECT_SECONDS = 30.0
_RETRY_BACKOFF = (0.1, 1.0)  # seconds between tries: the first, the longest


def _never_connected(exc: grpc.RpcError) -> bool:
    """Whether a call failed before its request left: no connection to the task."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (
        exc.details() or ""
    )


def _refused(exc: grpc.RpcError) -> bool:
    """Whether the task's host refused the connection: no process serves the address."""
    return _never_connected(exc) and "refused" in (exc.details() or "").lower()


def _connection_lost(exc: grpc.RpcError) -> bool:
    """Whether a call failed for want of a connection that may come back (not refused)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and not _refused(exc)


class RpcClient:
    """Calls one task. Thread-safe; one channel per client.

    >>> client = RpcClient("127.0.0.1:1", name="/job:ps/replica:0/task:0")
    >>> try:
    ...     client.call({"op": "ping"}, timeout=5)
    ... except errors.UnavailableError as e:
    ...     e.lost_tasks
    ('/job:ps/replica:0/task:0',)
    """

    def __init__(
        self,
        address: str,
        *,
        name: str,
        credentials=None,
        token: "str | None" = None,
        retry_seconds: float = 0.0,
    ):
        self.address = address
        self.name = name
        self.retry_seconds = retry_seconds  # see ``RECONNECT_SECONDS``; 0: no retries
        credentials = credentials if credentials is not None else tls_channel_credentials()
        if credentials is not None:
            channel = grpc.secure_channel(address, credentials, options=_OPTIONS)
        else:
            channel = grpc.insecure_channel(address, options=_OPTIONS)
        self._channel = channel
        self._method = channel.unary_unary(f"/{SERVICE}/{METHOD}")
        self._token = token
        self._lock = threading.Lock()

    def call(
        self, header: dict, arrays=(), blob: bytes = b"", *, timeout=DEFAULT_TIMEOUT, retry=True
    ):
        """Sends one message and returns the reply's ``(header, arrays, blob)``.

        Raises ``UnavailableError`` when the task cannot be reached (with
        ``retry_seconds`` and ``retry``: for that long, the call sent again as
        it reconnects),
        ``DeadlineExceededError`` past ``timeout`` seconds, and the handler's
        own error otherwise.
        """
        request = _wire.encode(header, arrays, blob)
        metadata = (
            (TOKEN_METADATA_KEY, self._token if self._token is not None else cluster_token()),
        )
        try:
            reply = self._method(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            if retry and self.retry_seconds > 0 and _connection_lost(exc):
                reply = self._again(request, metadata, header, exc, timeout)
            elif not _never_connected(exc):
                raise self._translate(exc, header) from None
            else:
                reply = self._after_refusal(request, metadata, header, exc, timeout)
        reply_header, reply_arrays, reply_blob = _wire.decode(reply)
        raise_if_error(reply_header)
        return reply_header, reply_arrays, reply_blob

    def _after_refusal(self, request, metadata, header, exc, timeout) -> bytes:
        """The reply of a call whose request never left, sent again once within the grace."""
        # The channel may still be waiting out its reconnect backoff (up to 1 s)
        # from while the task was down: a restarted task is reached if it serves
        # within the grace. The request was never sent, so sending it is safe.
        grace = _RECONNECT_GRACE_SECONDS
        if timeout is not None:
            grace = min(timeout, grace)
        try:
            return self._method(request, timeout=grace, metadata=metadata, wait_for_ready=True)
        except grpc.RpcError:
            raise self._translate(exc, header) from None

    def _again(self, request, metadata, header, exc, timeout) -> bytes:
        """The reply of a call whose connection was lost, sent until the task answers.

        Tries until ``retry_seconds`` have passed, each try within the time left
        (and ``timeout``), with a growing pause between them; then raises
        ``UnavailableError`` naming the task. A refused connection (the task's
        process is gone) or another failure ends it at once. The task may have
        applied the request already: it must be one the task answers once (a
        read, an ``update`` with an id).
        """
        start, first = time.monotonic(), exc
        deadline = start + self.retry_seconds
        pause = _RETRY_BACKOFF[0]
        logger.warning(
            "Lost the connection to %s at %s during a `%s` call; reconnecting for up to %.0f s. "
            "Received: %s",
            self.name,
            self.address,
            header.get("op"),
            self.retry_seconds,
            exc.details(),
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unreachable(first, exc, header, time.monotonic() - start) from None
            try_timeout = left if timeout is None else min(timeout, left)
            try:
                reply = self._method(request, timeout=try_timeout, metadata=metadata)
            except grpc.RpcError as again:
                window_over = time.monotonic() >= deadline
                if again.code() == grpc.StatusCode.DEADLINE_EXCEEDED and window_over:
                    raise self._unreachable(first, exc, header, time.monotonic() - start) from None
                if not _connection_lost(again):
                    raise self._translate(again, header) from None
                exc = again
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(2 * pause, _RETRY_BACKOFF[1])
                continue
            logger.warning(
                "Reached %s again after %.1f s; the `%s` call went through.",
                self.name,
                time.monotonic() - start,
                header.get("op"),
            )
            return reply

    def _unreachable(self, first, exc, header, waited: float) -> errors.UnavailableError:
        what = f"`{header.get('op')}` call to {self.name} at {self.address}"
        return errors.UnavailableError(
            f"Task {self.name} is unavailable: the {what} lost its connection and the task "
            f"stayed unreachable for {waited:.0f} s of reconnecting (the limit: "
            f"{self.retry_seconds:.0f} s). The task died, its host or link is down, or its "
            f"address is wrong. Received: {first.details()}; the last try: {exc.details()}",
            (self.name,),
        )

    def _translate(self, exc, header) -> errors.OpError:
        code = exc.code()
        what = f"`{header.get('op')}` call to {self.name} at {self.address}"
        details = exc.details()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.DeadlineExceededError(
                f"The {what} did not complete in time: the task is stuck or overloaded. "
                f"Received: {details}",
                (self.name,),
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return errors.UnauthenticatedError(f"The {what} was refused: {details}", (self.name,))
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return errors.InvalidArgumentError(
                f"The {what} was refused: the request is larger than the task accepts. "
                f"Raise {MAX_MESSAGE_ENV} on the serving task (its cap, in bytes), or send "
                f"less at once. Received: {details}",
                (self.name,),
            )
        if code == grpc.StatusCode.CANCELLED:
            return errors.CancelledError(f"The {what} was cancelled. Received: {details}")
        return errors.UnavailableError(
            f"Task {self.name} is unavailable: the {what} failed ({code.name}). The task "
            f"died or its address is wrong. Received: {details}",
            (self.name,),
        )

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()
