"""Errors that carry their structure from where they are found to where they are reported."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses, naming the field at fault: the server turns it into OpenAI's 400
    error object (param, code, message) without reading the message."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelLoadError(ValueError):
    """A model file is missing, malformed or unsupported; the message names the file."""
