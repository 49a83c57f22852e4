"""keyexpiry's dashboard mounted in the URLconf behind Django's staff login."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlencode

import pytest
from django.test import RequestFactory
from django.urls import resolve

from keyexpiry.django.clients import client

pytestmark = pytest.mark.usefixtures("django_db")


def get(path: str, user: Any, method: str = "get", **data: str) -> Any:
    if method == "post":  # a browser's form, as the dashboard reads it
        form = urlencode(data)
        request = RequestFactory().post(path, form, "application/x-www-form-urlencoded")
    else:
        request = RequestFactory().get(path, data)
    request.user = user
    match = resolve(path)
    return match.func(request, **match.kwargs)


STAFF = SimpleNamespace(is_active=True, is_staff=True, is_authenticated=True)
VISITOR = SimpleNamespace(is_active=True, is_staff=False, is_authenticated=True)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_staff_see_the_dashboard_others_the_login() -> None:
    key = client().create("Probe.record", "dash", ttl_s=600)
    refused = get("/keyexpiry/", VISITOR)
    assert refused.status_code == 302 and "/admin/login/" in refused["Location"]
    page = get("/keyexpiry/", STAFF)
    assert page.status_code == 200, page.content[:500]
    html = page.content.decode()
    assert 'href="/keyexpiry/static/dashboard.css"' in html  # links under the mount point
    found = get("/keyexpiry/tasks", STAFF, q="Probe@record")
    assert found.status_code == 200 and key in found.content.decode()
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert token is not None, html[:2000]
    paused = get(
        "/keyexpiry/pause", STAFF, "post", target="Probe", csrf=token.group(1), **{"for": "1h"}
    )
    assert paused.status_code == 303
    assert [p.target for p in client().paused()] == ["Probe"]
