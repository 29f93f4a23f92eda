"""The embedded store server's side of the handshake, as a state machine fed the bytes that arrive.

Before a connection has proved the job's secret the server gives it no thread and little
memory: the accept loop runs every pending handshake itself (non-blocking sockets, one
selector), with a frame limit of :data:`PREAUTH_FRAME_LIMIT` bytes and a deadline for the
*whole* handshake (:data:`HANDSHAKE_DEADLINE_S` from accept, however slowly the bytes trickle
in). Only an authenticated connection gets a thread of its own. The server proves itself only
after the client did, so nobody learns an HMAC of data of their choosing without the secret.

States and transitions (see :mod:`hyperpodrun.store.wire` for the frames)::

    HELLO --hello, no secret-----------> DONE     (answers "auth": false)
    HELLO --hello, secret--------------> AUTH     (answers its nonce, no proof)
    AUTH  --the client's proof is right-> DONE     (answers the server's proof)
    any   --bad frame, wrong proof------> FAILED   (answers an error; the connection is closed)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from enum import Enum

from hyperpodrun.store.wire import (
    HEADER,
    PROTOCOL_VERSION,
    encode_frame,
    new_nonce,
    proof,
    proofs_match,
)

__all__ = ["HANDSHAKE_DEADLINE_S", "PREAUTH_FRAME_LIMIT", "HandshakeState", "ServerHandshake"]

logger = logging.getLogger(__name__)

#: The largest frame a connection may send before it has proved the secret (a hello is ~100 bytes).
PREAUTH_FRAME_LIMIT = 4096
#: Seconds from accept within which the whole handshake must be done.
HANDSHAKE_DEADLINE_S = 5.0


class HandshakeState(str, Enum):
    HELLO = "hello"
    AUTH = "auth"
    DONE = "done"
    FAILED = "failed"


class ServerHandshake:
    """One connection's handshake: :meth:`feed` it what arrives, send what it returns."""

    def __init__(self, *, secret: bytes | None, peer: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.secret = secret
        self.peer = peer
        self.deadline = clock() + HANDSHAKE_DEADLINE_S
        self.state = HandshakeState.HELLO
        self._buf = bytearray()
        self._client_nonce = self._server_nonce = ""

    @property
    def leftover(self) -> bool:
        """Bytes past the handshake (a client must wait for the answer before its first request)."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Take bytes from the peer; the frames to send back (the state says what follows)."""
        self._buf += data
        out: list[bytes] = []
        while self.state in (HandshakeState.HELLO, HandshakeState.AUTH) and len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if length > PREAUTH_FRAME_LIMIT:
                return self._fail(f"a frame of {length} bytes before authentication", out)
            if len(self._buf) < HEADER.size + length:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            try:
                message = json.loads(body)
            except ValueError:
                return self._fail("a frame that is not JSON", out)
            if not isinstance(message, dict):
                return self._fail("a frame that is not a JSON object", out)
            out.extend(self._step(message))
        return out

    def _step(self, message: dict) -> list[bytes]:
        if self.state is HandshakeState.HELLO:
            if message.get("op") != "hello" or message.get("protocol") != PROTOCOL_VERSION:
                reply = {"error": {"kind": "protocol", "message": f"expected hello of protocol {PROTOCOL_VERSION}"}}
                self.state = HandshakeState.FAILED
                return [encode_frame(reply)]
            if self.secret is None:
                self.state = HandshakeState.DONE
                return [encode_frame({"ok": {"protocol": PROTOCOL_VERSION, "auth": False}})]
            self._client_nonce, self._server_nonce = str(message.get("nonce", ""))[:64], new_nonce()
            self.state = HandshakeState.AUTH
            return [encode_frame({"ok": {"protocol": PROTOCOL_VERSION, "auth": True, "nonce": self._server_nonce}})]
        secret = self.secret or b""  # AUTH is entered only with a secret
        expected = proof(secret, "client", self._client_nonce, self._server_nonce)
        if not secret or message.get("op") != "auth" or not proofs_match(expected, message.get("proof")):
            logger.warning("embedded store refused a connection from %s: wrong or no secret", self.peer)
            self.state = HandshakeState.FAILED
            return [encode_frame({"error": {"kind": "auth", "message": "wrong store secret"}})]
        self.state = HandshakeState.DONE
        mine = proof(secret, "server", self._client_nonce, self._server_nonce)
        return [encode_frame({"ok": {"proof": mine}})]

    def _fail(self, why: str, out: list[bytes]) -> list[bytes]:
        logger.info("embedded store dropped a connection from %s: %s", self.peer, why)
        self.state = HandshakeState.FAILED
        return out
