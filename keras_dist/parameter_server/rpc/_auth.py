"""The cluster token every parameter-server RPC carries.

Worker tasks run functions the coordinator sends them, so a server checks the
caller's token before it decodes anything in the request. The token comes from
``KERAS_DIST_CLUSTER_TOKEN`` (``keras-dist launch`` and the test clusters make
one and give it to every task). Without it, a process uses a random token of
its own: its in-process servers and clients agree, and another process is
refused until the variable is set on every task.

The token travels in plain text unless the tasks use TLS: set
``KERAS_DIST_TLS_CERT`` and ``KERAS_DIST_TLS_KEY`` (PEM files) on every task,
and ``KERAS_DIST_TLS_CA`` to the authority that signed them (the certificate
itself by default), whenever others can reach the network between the tasks.

>>> check_token([(TOKEN_METADATA_KEY, cluster_token())])
True
>>> check_token([(TOKEN_METADATA_KEY, "wrong")])
False
"""

import hmac
import os
import secrets

import grpc

TOKEN_ENV = "KERAS_DIST_CLUSTER_TOKEN"
# TLS for every server and client of the cluster: PEM files (the CA checks the peers).
TLS_CERT_ENV = "KERAS_DIST_TLS_CERT"
TLS_KEY_ENV = "KERAS_DIST_TLS_KEY"
TLS_CA_ENV = "KERAS_DIST_TLS_CA"
TOKEN_METADATA_KEY = "keras-dist-cluster-token"

_PROCESS_TOKEN = secrets.token_hex(16)


def cluster_token() -> str:
    """This process's cluster token: ``KERAS_DIST_CLUSTER_TOKEN``, else one of its own."""
    return os.environ.get(TOKEN_ENV) or _PROCESS_TOKEN


def token_from_environment() -> bool:
    """Whether the token was given to this process (other processes can then join)."""
    return bool(os.environ.get(TOKEN_ENV))


def new_token() -> str:
    """A fresh random token, for launchers to give every task of a cluster."""
    return secrets.token_hex(16)


def check_token(metadata) -> bool:
    """Whether the call's metadata (``(key, value)`` pairs) holds this cluster's token."""
    expected = cluster_token().encode()
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            received = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(received, expected)
    return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tls_server_credentials():
    """``grpc.ssl_server_credentials`` from ``KERAS_DIST_TLS_CERT``/``_KEY``, or ``None``."""
    cert, key = os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV)
    if not (cert and key):
        return None
    return grpc.ssl_server_credentials([(_read(key), _read(cert))])


def tls_channel_credentials():
    """``grpc.ssl_channel_credentials`` trusting ``KERAS_DIST_TLS_CA`` (else the cert)."""
    authority = os.environ.get(TLS_CA_ENV) or os.environ.get(TLS_CERT_ENV)
    if not authority:
        return None
    return grpc.ssl_channel_credentials(_read(authority))
