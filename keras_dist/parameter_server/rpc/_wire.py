"""The bytes of one parameter-server RPC: a small JSON header, then raw array buffers.

A message is ``MAGIC | u32 header length | header (JSON) | buffers | blob``.
The header lists each array's dtype, shape and byte count; the buffers follow
one after another, each padded to 64 bytes so NumPy reads them in place
(``np.frombuffer``, no copy). ``blob`` is an opaque tail (a serialized program
or a pickled function) that only the handler of an authenticated call decodes.
Tensors are never pickled and never copied into protobufs: the transport is
where parameter-server training spends its time (``docs/architecture.md``,
"Parameter servers").

>>> import numpy as np
>>> header, arrays, blob = decode(encode({"op": "read"}, [np.arange(3.0)], b"x"))
>>> header["op"], arrays[0].tolist(), blob
('read', [0.0, 1.0, 2.0], b'x')
"""

import json
import struct

import ml_dtypes
import numpy as np

MAGIC = b"KDP1"
_ALIGN = 64
_PADDING = bytes(_ALIGN)


def dtype_from_name(name: str) -> np.dtype:
    """A NumPy dtype from its name, including ML types NumPy lacks (``bfloat16``)."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def encode(header: dict, arrays=(), blob: bytes = b"") -> bytes:
    """One message: ``header`` (JSON-serializable), ``arrays`` as raw buffers, ``blob``."""
    arrays = [np.asarray(a, order="C") for a in arrays]
    header = dict(header, arrays=[[a.dtype.name, list(a.shape)] for a in arrays])
    header["blob"] = len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    start = len(MAGIC) + 4 + len(text)
    parts = [MAGIC, struct.pack("<I", len(text)), text, _PADDING[: -start % _ALIGN]]
    for a in arrays:
        # As bytes: ``memoryview`` refuses ML dtypes (bfloat16) the buffer protocol lacks.
        parts.append(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
        parts.append(_PADDING[: -a.nbytes % _ALIGN])
    parts.append(blob)
    return b"".join(parts)


def decode(message: bytes):
    """``(header, arrays, blob)`` of a message made by ``encode``; arrays are read-only views."""
    if message[: len(MAGIC)] != MAGIC:
        raise ValueError(
            "Not a keras_dist parameter-server message: the peer is not a keras_dist "
            f"task of the same version. Received: first bytes {bytes(message[:8])!r}"
        )
    (length,) = struct.unpack_from("<I", message, len(MAGIC))
    offset = len(MAGIC) + 4
    header = json.loads(bytes(message[offset : offset + length]))
    offset += length
    offset += -offset % _ALIGN
    arrays = []
    for dtype_name, shape in header.pop("arrays"):
        dtype = dtype_from_name(dtype_name)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(message, dtype=dtype, count=count, offset=offset)
        arrays.append(array.reshape(shape))
        offset += count * dtype.itemsize
        offset += -offset % _ALIGN
    blob_length = header.pop("blob")
    blob = bytes(message[offset : offset + blob_length])
    return header, arrays, blob
