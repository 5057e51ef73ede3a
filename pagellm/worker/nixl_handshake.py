"""The NixlConnector's side channel: a producer rank's KV layout and NIXL agent metadata, served over
TCP to the consumers that pull from it, and the check that both sides lay out their KV alike.

One exchange per connection: the producer sends a frame (4-byte big-endian length + JSON layout, then
4-byte length + agent metadata) and closes. Plain sockets in a daemon thread: the handshake happens
once per producer and rank, and the bulk data moves through NIXL.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import socket
import struct
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
"""How long a consumer waits for a producer's handshake before it gives up (and recomputes)."""
_LEN = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one rank's KV cache is laid out and where it lives (what a peer needs to read it)."""

    engine_id: str
    agent_name: str
    model: str
    """The architecture's name and vocabulary size: two engines of different models must not trade KV."""
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    """This rank's share of the KV heads."""
    head_dim: int
    tp_size: int
    tp_rank: int
    num_blocks: int
    block_bytes: int
    base_addrs: list[int]
    """Each cache tensor's address (keys and values per layer, in order)."""
    mem_type: str
    device_id: int

    MUST_MATCH = ("model", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "tp_size", "tp_rank",
                  "block_bytes")

    def mismatch(self, remote: KVLayout) -> str | None:
        """Why a peer's KV cannot be copied into this one block for block (naming the key), or None."""
        for key in self.MUST_MATCH:
            mine, theirs = getattr(self, key), getattr(remote, key)
            if mine != theirs:
                return f"the producer's {key} is {theirs!r}, this engine's is {mine!r}"
        return None

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> KVLayout:
        fields = json.loads(data)
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls)})


class HandshakeListener:
    """Serves this rank's layout and agent metadata to every consumer that connects."""

    def __init__(self, host: str, port: int, layout: KVLayout, metadata: bytes) -> None:
        layout_json = layout.to_json()
        self._frame = _LEN.pack(len(layout_json)) + layout_json + _LEN.pack(len(metadata)) + metadata
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._serve, name=f"nixl-handshake-{port}", daemon=True)
        self._thread.start()
        logger.info("NixlConnector: handshake listener on %s:%d", host, port)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    conn.settimeout(HANDSHAKE_TIMEOUT_S)
                    conn.sendall(self._frame)
                except OSError as e:  # the consumer went away: its pull fails and recomputes
                    logger.warning("NixlConnector: handshake with a consumer failed: %s", e)

    def close(self) -> None:
        self._sock.close()


def fetch_handshake(host: str, port: int) -> tuple[KVLayout, bytes]:
    """A producer rank's layout and agent metadata; OSError or ValueError when it cannot be had."""
    with socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S) as conn:
        layout = KVLayout.from_json(_read_frame(conn))
        metadata = _read_frame(conn)
    return layout, metadata


def _read_frame(conn: socket.socket) -> bytes:
    (length,) = _LEN.unpack(_read_exactly(conn, _LEN.size))
    return _read_exactly(conn, length)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ValueError(f"the producer's handshake ended after {n - left} of {n} bytes")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
