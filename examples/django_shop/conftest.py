"""keyexpiry in the shop's tests: its pool closed after each test, so the test database can be
dropped at the end (PostgreSQL refuses while a connection is open)."""

from collections.abc import Iterator

import pytest

from keyexpiry.django.testing import close


@pytest.fixture(autouse=True)
def _keyexpiry_closed() -> Iterator[None]:
    yield
    close()
