"""A route whose handler takes the Request alone and returns its Response: FastAPI's route class, less the work a
request does in FastAPI between the router and the handler.

FastAPI's handler for a route reads and parses a declared body, solves the dependencies, builds an exit stack for
them and validates what the handler returns. The generating routes use none of that: they parse their own bodies
on the worker pool (cobali.http.parse) and return a Response. At hundreds of short streams a second that
machinery was a share of the event loop's time (bench/engine/sleeping_backend.py). Routing, the route's 405, the
app's exception handlers and the route's place in /openapi.json stay FastAPI's: this is its documented hook
(`APIRouter(route_class=...)`, overriding `get_route_handler`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


class RequestRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        dependant = self.dependant
        name = dependant.request_param_name
        others = (dependant.path_params, dependant.query_params, dependant.header_params, dependant.cookie_params,
                  dependant.body_params, dependant.dependencies, dependant.response_param_name,
                  dependant.background_tasks_param_name)
        if name is None or any(others):  # anything else would need FastAPI's solving: a wrong route class
            raise TypeError(f"{self.path}: a RequestRoute's handler takes the Request alone")
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            return await endpoint(**{name: request})

        return handler
