"""TextStream: the pieces of one streamed answer, and the whole answer at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from .request import Generation, Piece


class _Collector:
    """Adds up pieces into a Generation."""

    def __init__(self, wants_log_prob: bool):
        self.texts: list[str] = []
        self.last = Piece("")
        self.wants_log_prob = wants_log_prob

    def add(self, piece: Piece) -> None:
        self.texts.append(piece.text)
        self.last = piece

    def generation(self) -> Generation:
        last = self.last
        return Generation("".join(self.texts), last.finish_reason, last.num_input_tokens, last.num_output_tokens,
                          last.cum_log_prob if self.wants_log_prob else None, last.glm_version)


class TextStream:
    """Text pieces as the server sends them; `generation` holds the whole answer once the stream is over.

        with client.stream("Once upon a time", max_tokens=64) as stream:
            for text in stream:
                print(text, end="", flush=True)
        print(stream.generation.finish_reason)

    Leaving early (break and close(), the end of the with block, an exception, Ctrl-C) cancels the request on
    the server, which frees its KV blocks. `request_id` names the request on the server: another thread can stop
    it with the client's cancel(stream.request_id), and the stream then ends with finish_reason "cancelled".
    """

    def __init__(self, pieces: Iterator[Piece], wants_log_prob: bool = False, request_id: str = ""):
        self._pieces = pieces
        self.request_id = request_id
        self._collector = _Collector(wants_log_prob)
        self.generation: Generation | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        while True:
            try:
                piece = next(self._pieces)
            except StopIteration:
                self.generation = self._collector.generation()
                raise
            self._collector.add(piece)
            if piece.text:
                return piece.text

    def until_done(self) -> Generation:
        for _ in self:
            pass
        return self.generation

    def close(self) -> None:
        """Cancel the request if it is still running."""
        self._pieces.close()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncTextStream:
    """TextStream for asyncio: `async for text in stream`, `async with`, `await stream.until_done()`;
    aclose() or cancelling the task cancels the request on the server; another task can stop it with the
    client's cancel(stream.request_id)."""

    def __init__(self, pieces: AsyncIterator[Piece], wants_log_prob: bool = False, request_id: str = ""):
        self._pieces = pieces
        self.request_id = request_id
        self._collector = _Collector(wants_log_prob)
        self.generation: Generation | None = None

    def __aiter__(self) -> "AsyncTextStream":
        return self

    async def __anext__(self) -> str:
        while True:
            try:
                piece = await self._pieces.__anext__()
            except StopAsyncIteration:
                self.generation = self._collector.generation()
                raise
            self._collector.add(piece)
            if piece.text:
                return piece.text

    async def until_done(self) -> Generation:
        async for _ in self:
            pass
        return self.generation

    async def aclose(self) -> None:
        await self._pieces.aclose()

    async def __aenter__(self) -> "AsyncTextStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
