"""Requests between tasks: the protocol, the bytes on the wire, the token, the transport."""
