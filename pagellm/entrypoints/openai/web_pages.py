"""The web page's static files: the chat playground at `/` and the live dashboard at `/dashboard`,
served by `pagellm serve` (`web_ui`) and, the chat page only, by `pagellm router` (which has no
engine, hence no dashboard).

The pages are static files shipped in the package (`web/`), plain HTML, CSS and JavaScript modules: no
build step, nothing fetched from elsewhere (they work offline).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

from pagellm.entrypoints.openai.errors import APIError

WEB_DIR = Path(__file__).parent / "web"
"""The page's files (package data)."""
STATIC_PREFIX = "/ui/"
"""Where the page's scripts and styles are served."""
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
CHAT_PAGE = {"/": "index.html"}
"""The chat page alone (a server without an engine's /stats)."""
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
"""Explicit, so that the scripts load as modules whatever the machine's mimetypes database says."""


def web_files() -> dict[str, Path]:
    """The files served under STATIC_PREFIX, by name."""
    return {path.name: path for path in WEB_DIR.iterdir() if path.suffix in MEDIA_TYPES}


def web_ui_paths(pages: Mapping[str, str] = PAGES) -> frozenset[str]:
    """The pages and their files: open without the API key (they hold no data; what they fetch asks for it)."""
    return frozenset(pages) | {STATIC_PREFIX + name for name in web_files()}


def add_web_ui_routes(app: FastAPI, pages: Mapping[str, str] = PAGES) -> None:
    """`pages` (path -> file: the chat page at `/`, the dashboard at `/dashboard`), their files under
    STATIC_PREFIX."""
    files = web_files()

    def page(name: str) -> Callable[[], Awaitable[FileResponse]]:
        async def serve_page() -> FileResponse:
            return FileResponse(WEB_DIR / name, media_type=MEDIA_TYPES[".html"])
        return serve_page

    for path, name in pages.items():
        app.add_api_route(path, page(name), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        path = files.get(name)
        if path is None:
            raise APIError(f"no file {name!r} in the web page", 404)
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix])
