"""A program that holds an embedded store's port without knowing the job's secret."""

from __future__ import annotations

import contextlib
import socket
import threading

from hyperpodrun.store.wire import PROTOCOL_VERSION, recv_frame, send_frame

__all__ = ["Impostor"]


class Impostor:
    """A program on the store's port that answers the handshake without the secret and records every frame."""

    def __init__(self, *, auth: bool) -> None:
        self.auth = auth
        self.frames: list[dict] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                while (frame := recv_frame(conn)) is not None:
                    self.frames.append(frame)
                    if frame.get("op") == "hello":
                        reply = {"protocol": PROTOCOL_VERSION, "auth": self.auth, "nonce": "n"}
                        send_frame(conn, {"ok": reply})
                    else:
                        send_frame(conn, {"ok": {"proof": "f" * 64} if frame.get("op") == "auth" else 1})

    def close(self) -> None:
        self.listener.close()
