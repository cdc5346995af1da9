"""The app of a server of many models (`cobali serve --models ...`): the router's front door and routes, and the
model table started and stopped with it (cobali.http.model_router)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.routing import Route

from cobali.frontend.errors import install_error_handlers
from cobali.http.loaded_model import BuildApp
from cobali.http.middleware import add_front_door
from cobali.http.model_router import MODEL_ROUTES, Forward, ModelRouter
from cobali.http.models_config import ModelsConfig
from cobali.http.routes import models as model_routes


def create_models_app(config: ModelsConfig, build: BuildApp) -> FastAPI:
    """The endpoint of many models; build: how one model's app is made (cobali.http.serve.build_app)."""
    router = ModelRouter(config, build)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.table.start()
        yield
        await router.table.stop()
        router.pool.close()

    app = FastAPI(title="cobali", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False},
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.models = router
    install_error_handlers(app)
    add_front_door(app, config.front)
    app.include_router(model_routes.router)
    for path in MODEL_ROUTES:
        app.router.routes.append(Route(path, Forward(), methods=["POST"]))
    return app

