"""The error a request gets: its own module so that the request schema and the picture checks
(:mod:`jaxdit.serve.images`, which the schema calls) both raise it without importing each other."""

from __future__ import annotations

from typing import Any

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request the service refuses: HTTP ``status``, the offending ``param`` (None: the whole request),
    a message for people, and OpenAI's error ``type``."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
