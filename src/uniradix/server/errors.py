"""The error body every route answers with (OpenAI's shape: message, type, code), in one
place below the app and its route modules, so that neither imports the other."""
from __future__ import annotations

from fastapi.responses import JSONResponse

KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
         408: "RequestTimeout", 413: "RequestTooLarge", 503: "ServiceUnavailable"}


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": KINDS.get(status, "InternalServerError"),
                                   "code": status}}, status_code=status, headers=headers)


#: the error body's JSON schema (the OpenAPI document's `Error`)
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string", "description": "what is wrong, naming the field"},
                   "type": {"type": "string", "enum": sorted(set(KINDS.values()) | {"InternalServerError"})},
                   "code": {"type": "integer", "description": "the HTTP status"}}}}}
