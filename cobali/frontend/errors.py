"""OpenAI-style error bodies for every failure: no bare 500 pages, no FastAPI 422 shapes."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("cobali.http")


class APIError(Exception):
    """An error to answer with: HTTP status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unknown_model(model: str, served: str) -> APIError:
    # OpenAI's own type for an unknown model; only unknown routes are `not_found_error`.
    return APIError(404, f"the model '{model}' does not exist; this server serves '{served}'",
                    param="model", code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="server_error", code="service_unavailable")


def validation_error(err: RequestValidationError | ValidationError) -> APIError:
    """Pydantic's first complaint, named by its field path (without FastAPI's leading 'body'); FastAPI's
    validation of a parameter, or a body's own (parse.py)."""
    errors = err.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc and first.get("ctx", {}).get("field"):  # a check over the whole body names the field itself
        loc = [first["ctx"]["field"]]
    if first.get("type") == "json_invalid":
        return bad_request(f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    param = ".".join(loc) or None
    text = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for our validators' ValueErrors
    message = f"{param}: {text}" if param else text
    return bad_request(message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return APIError(err.status_code, str(err.detail), type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        # A bug, not bad input: log the traceback, still answer in the API's error shape.
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(err).__name__}", "server_error").response()
