"""What the router and the workers share over HTTP: OpenAI-shaped errors and Bearer checks."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), kind)
