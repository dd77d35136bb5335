"""The operators' kit: the web console (``/ui/``) and the admin API (``/api/v1/``),
each under a prefix of its own so a reverse proxy can guard them apart from the package
routes (docs/architecture.md, "Operating: console, API and logs")."""

from __future__ import annotations

from starlette.routing import BaseRoute, Mount, Route

from proxy.admin import api, console


def routes() -> list[BaseRoute]:
    return [
        Route("/ui", console.to_index, methods=["GET", "HEAD"]),
        Mount("/ui", routes=console.routes()),
        Mount("/api", routes=api.routes()),
    ]
