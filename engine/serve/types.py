"""``aotlm.serve.types``: the request types' former import path (they are ``aotlm.batching.types``)."""

from aotlm.batching.types import (
    EngineStopped,
    Finish,
    InvalidRequest,
    QueueFull,
    Request,
    SamplingParams,
    Token,
)

__all__ = ["EngineStopped", "Finish", "InvalidRequest", "QueueFull", "Request", "SamplingParams", "Token"]
