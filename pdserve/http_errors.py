"""What the router and the workers share over HTTP: OpenAI-shaped errors and Bearer checks."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.wire import BadMessage, decode


log = logging.getLogger("pdserve.http")


class APIError(Exception):
    """Raised anywhere in a handler: answered as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}
    return JSONResponse(body, e.status, headers=e.headers)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return error_response(APIError(status, message, kind, param))


async def message_body(request: Request, kind):
    """The request's body as a wire message of `kind` (pdserve/wire.py), or a 400 naming the field."""
    try:
        return decode(await request.body(), kind)
    except BadMessage as e:
        raise APIError(400, str(e), param=e.field) from None


def require_bearer(request: Request, secret: str, what: str = "bearer token") -> None:
    """Raises 401 unless the request carries `Authorization: Bearer <secret>` (no secret: open)."""
    if secret and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                          f"Bearer {secret}".encode()):
        raise APIError(401, f"missing or wrong {what}", "authentication_error")


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, its own or the framework's, in the one shape."""

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return validation_error(exc.errors())

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):  # a bug: the client hears nothing internal, the log all of it
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return error(500, "internal error", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), kind)


# Pydantic names the member of a union that failed in an error's location ("str", "list[str]",
# "function-after[...]"); a client knows only field names and indexes.
_TYPE_TAGS = {"str", "int", "bool", "float", "list", "dict", "none", "constrained-str", "json-or-python"}


def _field_path(loc: tuple) -> str | None:
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> JSONResponse:
    """400 naming the field that failed and why. Of a union's errors, the ones from the member of
    the value's own type say why (a list of ids with a negative one: not "should be a string")."""
    if not errors:
        return error(400, "invalid request body")
    telling = [e for e in errors if not str(e.get("type", "")).endswith("_type")] or errors
    where = _field_path(tuple(telling[0].get("loc", ())))
    reasons: list[str] = []
    for e in telling:
        msg = str(e.get("msg", "invalid value"))
        if _field_path(tuple(e.get("loc", ()))) == where and msg not in reasons:
            reasons.append(msg)
    return error(400, f"{where or 'body'}: {'; or '.join(reasons[:3])}", param=where)
