"""The embedded store's wire format and its connection handshake.

Frames: a 4-byte big-endian length, then a JSON object (values base64-encoded); one
request and one response per frame.

Handshake, on every connection, before any other request (HMAC-SHA256 challenge and
response in both directions, so the secret itself never crosses the wire; the client
proves first, so the server hands no proof to a peer that does not know the secret)::

    client -> {"op": "hello", "protocol": 3, "nonce": C}
    server -> {"ok": {"protocol": 3, "auth": true, "nonce": S}}
    client -> {"op": "auth", "proof": HMAC(k, "client" C S)}
    server -> {"ok": {"proof": HMAC(k, "server" C S)}}    or an error, and the connection is closed
    (the client checks the server's proof before its first request)

A server without a secret answers ``"auth": false``; a client that holds a secret refuses
it (something else holds the port). A server at its connection limit answers an error of
kind ``busy`` and closes; the client tries again within its timeout. Proofs are compared
with :func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

from hyperpodrun.store.base import StoreError

__all__ = [
    "HEADER",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "arg",
    "b64",
    "encode_frame",
    "new_nonce",
    "proof",
    "proofs_match",
    "recv_frame",
    "send_frame",
    "unb64",
]

PROTOCOL_VERSION = 3
_MAX_FRAME = 64 * 1024 * 1024
HEADER = struct.Struct("!I")


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: bytes, role: str, client_nonce: str, server_nonce: str) -> str:
    """HMAC-SHA256 of both nonces, bound to the side (``client``/``server``) that proves."""
    message = f"hyperpodrun-embedded-store:{role}:{client_nonce}:{server_nonce}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def proofs_match(expected: str, received: object) -> bool:
    return isinstance(received, str) and hmac.compare_digest(expected.encode(), received.encode())


class ProtocolError(ConnectionError):
    """The peer sent something that is not a frame of this protocol."""


def encode_frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > _MAX_FRAME:
        raise StoreError(f"embedded store message of {len(data)} bytes exceeds {_MAX_FRAME} bytes")
    return HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode_frame(message))


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ProtocolError("connection closed in the middle of a frame")
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or ``None`` if the peer closed the connection between frames."""
    header = recv_exact(sock, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > _MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds {_MAX_FRAME} bytes")
    body = recv_exact(sock, length)
    if body is None:
        raise ProtocolError("connection closed after a frame header")
    try:
        message = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"frame is not JSON: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def arg(request: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = request.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"request field {name!r} is missing or of the wrong type")
    return value
