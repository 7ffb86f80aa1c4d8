"""Stop strings in streamed text: found however the tokens split them, and never sent.

The matcher is an Aho-Corasick automaton over the request's stop strings. Fed the text one character at a time, it
knows after each character whether a stop string ends there, and how many characters at the end of the text could
still be the beginning of one. A character costs amortized constant time whatever the number of stop strings, and
at most their longest length in the worst case (the failure links it follows), so the engine thread's work per
token is bounded by the token's characters and the limits on stop strings (request_schema.py), not by how many a
request sends.

The answer ends at the first stop string to be completed: the one that ends earliest in the text (and, of those
ending at the same character, the longest). That does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from collections import deque


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]):
        # One state per distinct prefix of the stop strings; state 0 is the empty prefix.
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]  # the length of each state's prefix
        for text in stop_strings:
            state = 0
            for char in text:
                if char not in self._next[state]:
                    self._next[state][char] = len(self._next)
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                state = self._next[state][char]
        ends = {self._state_of(text) for text in stop_strings if text}
        # _fallback[s]: the state of the longest proper suffix of s's prefix that is itself a prefix of a stop
        # string. _match[s]: the length of the longest stop string that s's prefix ends with (0: none).
        self._fallback = [0] * len(self._next)
        self._match = [0] * len(self._next)
        queue = deque(self._next[0].values())  # breadth first: a state's fallback is shallower than itself
        while queue:
            state = queue.popleft()
            self._match[state] = self._depth[state] if state in ends else self._match[self._fallback[state]]
            for char, child in self._next[state].items():
                self._fallback[child] = self._step(self._fallback[state], char)
                queue.append(child)
        self.state = 0

    def _state_of(self, text: str) -> int:
        state = 0
        for char in text:
            state = self._next[state][char]
        return state

    def _step(self, state: int, char: str) -> int:
        while state and char not in self._next[state]:
            state = self._fallback[state]
        return self._next[state].get(char, 0)

    def feed(self, char: str) -> int:
        """Read one more character; returns the length of the longest stop string that ends with it, or 0."""
        self.state = self._step(self.state, char)
        return self._match[self.state]

    @property
    def partial(self) -> int:
        """How many characters at the end of the text read so far could be the beginning of a stop string."""
        return self._depth[self.state]


class StopStringFilter:
    """Holds back streamed chunks (token ids with their text, whole characters) while their text could still be the
    start of a stop string. When a stop string appears, the chunks covering the text before it are released with
    the number of characters of their text to keep, since a stop string may begin inside a token."""

    def __init__(self, stop_strings: list[str]):
        self._matcher = StopStringMatcher([s for s in stop_strings if s])
        self._held: deque[tuple[list[int], str]] = deque()
        self._held_chars = 0

    def push(self, token_ids: list[int], text: str) -> tuple[list[int], int | None, bool]:
        """Returns (ids to send, characters of their text to keep or None for all, whether a stop string ended it)."""
        start = self._held_chars
        self._held.append((token_ids, text))
        self._held_chars += len(text)
        for end, char in enumerate(text, start + 1):
            length = self._matcher.feed(char)
            if length:
                stop_at = end - length  # where the stop string begins, counted from the first held character
                return self._release(lambda covered, _: covered < stop_at), stop_at, True
        safe = self._held_chars - self._matcher.partial
        return self._release(lambda covered, chunk_text: covered + len(chunk_text) <= safe), None, False

    def flush(self) -> list[int]:
        return self._release(lambda covered, _: True)

    def _release(self, take) -> list[int]:
        """The held chunks from the front, while take(characters released before it, its text) says so."""
        released, covered = [], 0
        while self._held and take(covered, self._held[0][1]):
            ids, text = self._held.popleft()
            released += ids
            covered += len(text)
        self._held_chars -= covered
        return released
