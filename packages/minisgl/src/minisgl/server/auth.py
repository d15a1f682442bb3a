"""`--api-key`: an ASGI gate in front of the server's app. A request to a `/v1` route needs
`Authorization: Bearer KEY` (the scheme in any case), compared in constant time; without it:
401 with an OpenAI error body (`invalid_request_error`, code `invalid_api_key`, as OpenAI
answers) and `WWW-Authenticate: Bearer`. Other routes (`/health`, `/metrics`, `/openapi.json`)
stay open, as vLLM's `--api-key` leaves everything outside `/v1`. The key is never echoed."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from minisgl.server.protocol import APIError

PROTECTED_PREFIX = "/v1"
MESSAGE = "missing or incorrect API key: send it as the header 'Authorization: Bearer <key>'"


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's `Authorization: Bearer ...` header (None: none)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class ApiKeyGate:
    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self._key = key.encode()

    def allowed(self, scope: dict) -> bool:
        path = scope.get("path", "")
        if path != PROTECTED_PREFIX and not path.startswith(PROTECTED_PREFIX + "/"):
            return True
        token = bearer_token(scope.get("headers") or [])
        return token is not None and hmac.compare_digest(token, self._key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        body = APIError(401, MESSAGE, None, "invalid_api_key").body()
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
