"""`specter serve`: the OpenAI-compatible HTTP server over one `Engine` (docs/ARCHITECTURE.md, "Serving")."""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    """`specter.server.app.create_app`, imported on use so that `import specter.server` needs no web packages."""
    from specter.server.app import create_app as create

    return create(*args, **kwargs)
