"""The images that chat `image_url` parts point to: `data:image/...;base64,` URLs decoded, `http(s)://`
URLs fetched (from --allowed-media-domains, with a timeout and a size cap), `file://` URLs read under
--allowed-local-media-path; anything else refused. Every failure is a ValueError naming the part.

The offline API loads images in its own thread (`load`); the server fetches them without blocking
its event loop and decodes them on a small pool of threads (`load_async`)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.parse
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass

import httpx
from PIL import Image

from pagellm.config import MultiModalConfig

IMAGE_FETCH_TIMEOUT_ENV = "PAGELLM_IMAGE_FETCH_TIMEOUT"
"""Seconds an http(s) image may take to arrive in all (vLLM: VLLM_IMAGE_FETCH_TIMEOUT); default 5."""
MAX_IMAGE_BYTES_ENV = "PAGELLM_MAX_IMAGE_BYTES"
"""Largest image, in bytes, that a URL may give (fetched, read or base64-decoded); default 20 MiB."""
DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_MAX_IMAGE_BYTES = 20 << 20


@dataclass(slots=True, frozen=True)
class MediaLimits:
    """Where images may come from and how long and large they may be."""

    config: MultiModalConfig
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    @classmethod
    def from_env(cls, config: MultiModalConfig) -> MediaLimits:
        try:
            timeout = float(os.environ.get(IMAGE_FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S))
            max_bytes = int(os.environ.get(MAX_IMAGE_BYTES_ENV, DEFAULT_MAX_IMAGE_BYTES))
        except ValueError as e:
            raise ValueError(f"{IMAGE_FETCH_TIMEOUT_ENV} / {MAX_IMAGE_BYTES_ENV} must be numbers: {e}") from None
        return cls(config, timeout, max_bytes)


def load(url: str, limits: MediaLimits, where: str) -> Image.Image:
    """The image at `url` (the part `where`, for errors), fetched and decoded in this thread."""
    scheme = _scheme(url, limits, where)
    if scheme == "data":
        return decode(_data_bytes(url, limits, where), where)
    if scheme == "file":
        return decode(_file_bytes(url, limits, where), where)
    try:
        with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=True) as client, \
                client.stream("GET", url) as response:
            return decode(_checked_body(response, response.iter_bytes(), limits, where), where)
    except httpx.TimeoutException:
        raise ValueError(_timeout_message(url, limits, where)) from None
    except httpx.HTTPError as e:
        raise ValueError(f"{where}: fetching {_short(url)} failed: {e}") from None


async def load_async(url: str, limits: MediaLimits, where: str, pool: Executor) -> Image.Image:
    """`load` that keeps the event loop free: the fetch awaits, reading and decoding run on `pool`."""
    scheme = _scheme(url, limits, where)
    loop = asyncio.get_running_loop()
    if scheme != "http":
        reader = _data_bytes if scheme == "data" else _file_bytes
        return await loop.run_in_executor(pool, lambda: decode(reader(url, limits, where), where))
    try:
        # The whole fetch is bounded, however slowly its bytes trickle in.
        data = await asyncio.wait_for(_fetch(url, limits, where), limits.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise ValueError(_timeout_message(url, limits, where)) from None
    except httpx.HTTPError as e:
        raise ValueError(f"{where}: fetching {_short(url)} failed: {e}") from None
    return await loop.run_in_executor(pool, decode, data, where)


def decode(data: bytes, where: str) -> Image.Image:
    """The image in `data`, fully read (a truncated file fails here, not later in the processor)."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: the image could not be decoded ({type(e).__name__}: {e})") from None
    return image


def _scheme(url: str, limits: MediaLimits, where: str) -> str:
    """"data", "file" or "http" (for https too), once `url` is allowed."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: the image url must be a non-empty string")
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    if scheme == "data":
        return "data"
    if scheme in ("http", "https"):
        domains = limits.config.allowed_media_domains
        if domains is not None and (parsed.hostname or "").lower() not in domains:
            raise ValueError(f"{where}: the host {parsed.hostname!r} is not among this server's "
                             f"--allowed-media-domains ({', '.join(domains)})")
        return "http"
    if scheme == "file":
        if limits.config.allowed_local_media_path is None:
            raise ValueError(f"{where}: file:// URLs are refused unless the engine is started with "
                             "--allowed-local-media-path")
        return "file"
    raise ValueError(f"{where}: unsupported image URL scheme {scheme or 'none'!r}: give a data:image/...;base64, "
                     "URL, an http(s):// URL, or a file:// URL under --allowed-local-media-path")


def _data_bytes(url: str, limits: MediaLimits, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise ValueError(f"{where}: a data URL must look like data:image/png;base64,<base64 bytes>")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ValueError(_too_large(where, limits))
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data URL's payload is not valid base64") from None


def _file_bytes(url: str, limits: MediaLimits, where: str) -> bytes:
    folder = limits.config.allowed_local_media_path
    assert folder is not None  # _scheme refused file URLs otherwise
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: a file URL names no host (file:///path), got {parsed.netloc!r}")
    # Resolved: neither `..` nor a symbolic link leads out of the folder.
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    if os.path.commonpath([path, folder]) != folder:
        raise ValueError(f"{where}: the file {path!r} is outside --allowed-local-media-path ({folder})")
    try:
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{where}: the file could not be read ({e.strerror})") from None
    if len(data) > limits.max_bytes:
        raise ValueError(_too_large(where, limits))
    return data


def _checked_body(response: httpx.Response, chunks: Iterable[bytes], limits: MediaLimits, where: str) -> bytes:
    _check_status(response, where)
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > limits.max_bytes:
            raise ValueError(_too_large(where, limits))
    return bytes(body)


async def _fetch(url: str, limits: MediaLimits, where: str) -> bytes:
    async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=True) as client, \
            client.stream("GET", url) as response:
        return await _checked_body_async(response, limits, where)


async def _checked_body_async(response: httpx.Response, limits: MediaLimits, where: str) -> bytes:
    _check_status(response, where)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limits.max_bytes:
            raise ValueError(_too_large(where, limits))
    return bytes(body)


def _check_status(response: httpx.Response, where: str) -> None:
    if response.status_code != 200:
        raise ValueError(f"{where}: fetching {_short(str(response.url))} answered HTTP {response.status_code}")


def _too_large(where: str, limits: MediaLimits) -> str:
    return f"{where}: the image is larger than {limits.max_bytes} bytes ({MAX_IMAGE_BYTES_ENV})"


def _timeout_message(url: str, limits: MediaLimits, where: str) -> str:
    return (f"{where}: fetching {_short(url)} timed out after {limits.fetch_timeout_s:g} s "
            f"({IMAGE_FETCH_TIMEOUT_ENV})")


def _short(url: str) -> str:
    return url if len(url) <= 100 else url[:97] + "..."
