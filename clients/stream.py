"""TextStream: the pieces of one streamed answer, and the whole answer at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator

from .request import Generation, Piece


class _Collector:
    """Adds up pieces into a Generation per answer (num_return_sequences)."""

    def __init__(self, wants_log_prob: bool):
        self.texts: dict[int, list[str]] = {0: []}
        self.last: dict[int, Piece] = {0: Piece("")}
        self.wants_log_prob = wants_log_prob

    def add(self, piece: Piece) -> None:
        self.texts.setdefault(piece.sequence_index, []).append(piece.text)
        self.last[piece.sequence_index] = piece

    def generations(self) -> list[Generation]:
        return [Generation("".join(self.texts[index]), last.finish_reason, last.num_input_tokens,
                           last.num_output_tokens, last.cum_log_prob if self.wants_log_prob else None,
                           last.glm_version)
                for index, last in sorted(self.last.items())]


class _Answers:
    """What both streams keep: the pieces' source, the request id and, once over, the answers."""

    def __init__(self, pieces, wants_log_prob: bool = False, request_id: str = ""):
        self._pieces = pieces
        self.request_id = request_id
        self._collector = _Collector(wants_log_prob)
        self.generation: Generation | None = None  # the (first) answer, once the stream is over
        self.generations: list[Generation] = []  # every answer, by sequence_index (num_return_sequences)

    def _finish(self) -> None:
        self.generations = self._collector.generations()
        self.generation = self.generations[0]


class TextStream(_Answers):
    """Text pieces as the server sends them; `generation` holds the whole answer once the stream is over.

        with client.stream("Once upon a time", max_tokens=64) as stream:
            for text in stream:
                print(text, end="", flush=True)
        print(stream.generation.finish_reason)

    Leaving early (break and close(), the end of the with block, an exception, Ctrl-C) cancels the request on
    the server, which frees its KV blocks. `request_id` names the request on the server: another thread can stop
    it with the client's cancel(stream.request_id), and the stream then ends with finish_reason "cancelled".
    With num_return_sequences above 1 the pieces of all answers come interleaved: `generations` has each answer.
    """

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        while True:
            try:
                piece = next(self._pieces)
            except StopIteration:
                self._finish()
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


class AsyncTextStream(_Answers):
    """TextStream for asyncio: `async for text in stream`, `async with`, `await stream.until_done()`;
    aclose() or cancelling the task cancels the request on the server; another task can stop it with the
    client's cancel(stream.request_id)."""

    def __aiter__(self) -> "AsyncTextStream":
        return self

    async def __anext__(self) -> str:
        while True:
            try:
                piece = await self._pieces.__anext__()
            except StopAsyncIteration:
                self._finish()
                raise
            self._collector.add(piece)
            if piece.text:
                return piece.text

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces themselves, with their sequence_index and figures (for num_return_sequences above 1)."""
        while True:
            try:
                piece = await self._pieces.__anext__()
            except StopAsyncIteration:
                self._finish()
                return
            self._collector.add(piece)
            yield piece

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
