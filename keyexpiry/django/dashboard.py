"""keyexpiry's dashboard inside a Django project, behind Django's staff login:
`path("keyexpiry/", include("keyexpiry.django.urls"))` in the URLconf.

The dashboard is an ASGI app (`keyexpiry.web`); a Django view hands it each request, under the
URL it is mounted at (its links follow the ASGI `root_path`). Django's login decides who may
see it (`staff_member_required`); the dashboard's own guard is given a per-process token that
only this view sends, so no request reaches it without Django's check. Its forms carry its own
CSRF token (checked by the dashboard), so the view is exempt from Django's.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from asgiref.sync import async_to_sync
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

_lock = threading.Lock()
_app: tuple[Any, str, Any] | None = None


def _dashboard() -> tuple[Any, str]:
    """The dashboard app on the process's Client (made anew when that Client is: settings
    changed), and the token its guard wants."""
    global _app
    from keyexpiry.django.clients import client
    from keyexpiry.web import create_app

    ke = client()
    with _lock:
        if _app is None or _app[2] is not ke:
            token = secrets.token_urlsafe(32)
            _app = (create_app(ke.settings, token=token, client=ke), token, ke)
        return _app[0], _app[1]


@csrf_exempt
@staff_member_required
def dashboard(request: HttpRequest, subpath: str = "") -> HttpResponse:
    """Serve one dashboard page or action for a staff member."""
    app, token = _dashboard()
    root_path = request.path[: len(request.path) - len(subpath)].rstrip("/")
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in request.headers.items()
        if name.lower() not in ("authorization", "host")
    ]
    headers.append((b"authorization", f"Bearer {token}".encode()))
    # The Host Django checked against ALLOWED_HOSTS (get_host), the only one the dashboard sees.
    headers.append((b"host", request.get_host().encode("latin-1")))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": root_path + "/" + subpath,
        "raw_path": (root_path + "/" + subpath).encode(),
        "root_path": root_path,
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1"),
        "headers": headers,
        "client": (request.META.get("REMOTE_ADDR") or "127.0.0.1", 0),
        "server": (request.get_host().split(":")[0], int(request.get_port() or 80)),
    }
    status, response_headers, body = async_to_sync(_call)(app, scope, request.body)
    response = HttpResponse(body, status=status)
    for name, value in response_headers:
        if name.lower() not in ("content-length", "transfer-encoding"):
            response[name] = value
    return response


async def _call(app: Any, scope: dict[str, Any], body: bytes) -> tuple[int, list[Any], bytes]:
    sent = False
    status = 500
    headers: list[tuple[str, str]] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.extend(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
            )
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)
