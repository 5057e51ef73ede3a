"""A small asyncio Redis client (RESP2 over TCP): the few commands the router needs.

redis-py is not a dependency of pagellm; the protocol is a dozen lines. Commands are sent on a
small pool of connections; a connection that fails is dropped and the error raised as
`RedisError`, which callers turn into a logged fallback (no caching, in-process limits).
"""
from __future__ import annotations

import asyncio
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 2.0
POOL_SIZE = 8

Reply = int | bytes | list | None


class RedisError(Exception):
    """Redis is unreachable, timed out, or answered with an error."""


class RedisClient:
    """`redis://[:password@]host[:port][/db]`; call `execute("INCRBY", key, 3)`."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 6379
        self.password = parsed.password
        self.db = int(parsed.path.lstrip("/") or 0)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def execute(self, *args: str | bytes | int | float) -> Reply:
        return (await self.pipeline([args]))[0]

    async def pipeline(self, commands: list[tuple[str | bytes | int | float, ...]]) -> list[Reply]:
        """Send the commands in one write and read their replies in order."""
        conn = self._idle.pop() if self._idle else await self._connect()
        reader, writer = conn
        try:
            writer.write(b"".join(_encode(c) for c in commands))
            await asyncio.wait_for(writer.drain(), COMMAND_TIMEOUT_S)
            replies = [await asyncio.wait_for(_read(reader), COMMAND_TIMEOUT_S) for _ in commands]
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            writer.close()
            raise RedisError(f"redis at {self.host}:{self.port}: {e!r}") from e
        except BaseException:
            writer.close()  # a cancelled command leaves a reply unread: the connection is out of step
            raise
        if len(self._idle) < POOL_SIZE:
            self._idle.append(conn)
        else:
            writer.close()
        for reply in replies:
            if isinstance(reply, RedisError):
                raise reply
        return replies

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), CONNECT_TIMEOUT_S)
            setup = ([("AUTH", self.password)] if self.password else []) + ([("SELECT", self.db)] if self.db else [])
            for command in setup:
                writer.write(_encode(command))
                reply = await asyncio.wait_for(_read(reader), COMMAND_TIMEOUT_S)
                if isinstance(reply, RedisError):
                    writer.close()
                    raise reply
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            raise RedisError(f"redis at {self.host}:{self.port} is unreachable: {e!r}") from e
        return reader, writer

    async def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()


def _encode(args: tuple[str | bytes | int | float, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        data = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


async def _read(reader: asyncio.StreamReader) -> Reply | RedisError:
    line = await reader.readuntil(b"\r\n")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        return RedisError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        return None if size < 0 else (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        size = int(body)
        return None if size < 0 else [await _read(reader) for _ in range(size)]
    raise ValueError(f"unexpected reply {line[:40]!r}")
