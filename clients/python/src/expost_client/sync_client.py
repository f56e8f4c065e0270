"""The blocking client, :class:`ExpostClient`: performs the effects of expost_client._endpoints with
httpx.Client and time.sleep."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar, Literal, TypeVar

import httpx

from expost_client._endpoints import (
    DEFAULT_URL,
    _advance,
    _Call,
    _Endpoints,
    _Op,
    _Report,
    _returning,
    _Sleep,
    _Stream,
)
from expost_client.retry import RetryPolicy

__all__ = ["ExpostClient"]

T = TypeVar("T")


class ExpostClient(_Endpoints):
    """Blocking client. Use as a context manager, or call :meth:`close`."""

    _asynchronous: ClassVar[Literal[False]] = False

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, key, retry)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> ExpostClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _stream(self, op: _Stream) -> Iterator[Any]:
        reply, error = None, None
        while True:
            try:
                effect = _advance(op, reply, error)
            except StopIteration:
                return
            reply, error = None, None
            if isinstance(effect, _Call):
                try:
                    reply = self._http.request(**effect.request_args())
                except httpx.TransportError as exc:
                    error = exc
            elif isinstance(effect, _Sleep):
                time.sleep(effect.seconds)
            elif isinstance(effect, _Report):
                effect.progress(effect.body)
            else:
                yield effect.item

    def _execute(self, op: _Op[T]) -> T:
        result: list[T] = []
        for _ in self._stream(_returning(op, result)):
            pass
        return result[0]
