"""The web dashboard: `keyexpiry web`, or `create_app()` mounted in your own ASGI app."""

from keyexpiry.web.app import create_app

__all__ = ["create_app"]
