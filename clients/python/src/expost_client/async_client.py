"""The asyncio client, :class:`AsyncExpostClient`: performs the effects of expost_client._endpoints with
httpx.AsyncClient and asyncio.sleep."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
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

__all__ = ["AsyncExpostClient"]

T = TypeVar("T")


class AsyncExpostClient(_Endpoints):
    """The asyncio twin of :class:`ExpostClient`: the same methods, awaited (``ledger`` is an async
    iterator, and a ``progress`` callback may be a coroutine function)."""

    _asynchronous: ClassVar[Literal[True]] = True

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, key, retry)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncExpostClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _stream(self, op: _Stream) -> AsyncIterator[Any]:
        reply, error = None, None
        while True:
            try:
                effect = _advance(op, reply, error)
            except StopIteration:
                return
            reply, error = None, None
            if isinstance(effect, _Call):
                try:
                    reply = await self._http.request(**effect.request_args())
                except httpx.TransportError as exc:
                    error = exc
            elif isinstance(effect, _Sleep):
                await asyncio.sleep(effect.seconds)
            elif isinstance(effect, _Report):
                result = effect.progress(effect.body)
                if inspect.isawaitable(result):
                    await result
            else:
                yield effect.item

    async def _execute(self, op: _Op[T]) -> T:
        result: list[T] = []
        async for _ in self._stream(_returning(op, result)):
            pass
        return result[0]
