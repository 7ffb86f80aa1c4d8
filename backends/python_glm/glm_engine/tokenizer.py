"""The checkpoint's tokenizer, and the streaming rule that keeps multi-byte characters whole.

One module used by preprocessing, the engine's streaming and postprocessing, so they can never disagree.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from .config import CheckpointError

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes, so an unfinished one spans at most the last 3 byte-level tokens.
_MAX_UNFINISHED_TOKENS = 4


class GlmTokenizer:
    """A `tokenizer.json` tokenizer. Encoding adds the checkpoint's own prefix (GLM-4: `[gMASK]<sop>`);
    decoding drops special tokens."""

    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"{model_dir!r} has no tokenizer.json (a Hugging Face fast tokenizer is required)")
        self._tokenizer = Tokenizer.from_file(path)
        # What encoding adds before a prompt: the ids that an empty text encodes to (GLM-4: [gMASK]<sop>).
        self._prefix = self._tokenizer.encode("", add_special_tokens=True).ids
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict = {}
        if os.path.isfile(config_path):
            with open(config_path) as f:
                self.config = json.load(f)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """With add_special_tokens, the checkpoint's prompt prefix is added (GLM-4: [gMASK]<sop>), once: a prompt
        that already starts with it (one made by the chat template) does not get a second."""
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        prefix = self._prefix
        if add_special_tokens and prefix and ids[len(prefix):2 * len(prefix)] == prefix:
            del ids[:len(prefix)]
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return self._tokenizer.decode_batch(batch, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


class CompleteTextChunker:
    """Groups a stream of token ids into chunks that each decode, alone, to whole characters.

    Byte-level BPE can split one character (a Chinese one takes 3 UTF-8 bytes) across tokens, and decoding such a
    token alone gives U+FFFD. Tokens are held back until the text they start is complete, so that a stateless
    postprocessing step that decodes each chunk alone produces, concatenated, exactly the text of decoding all
    tokens at once (the failure of decoding each streamed token alone, TensorRT-LLM backend issue #332).
    """

    def __init__(self, tokenizer: GlmTokenizer):
        self._tokenizer = tokenizer
        self._pending: list[int] = []  # always starts on a character boundary

    def push(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Add new tokens; return those that are now safe to decode (possibly none), with their text."""
        self._pending += token_ids
        # The longest prefix whose text does not end inside a character. Cutting there is exact, because text
        # that ends on a whole character never changes when more bytes follow.
        shortest = max(0, len(self._pending) - _MAX_UNFINISHED_TOKENS)
        for cut in range(len(self._pending), shortest, -1):
            text = self._tokenizer.decode(self._pending[:cut])
            if not text.endswith(REPLACEMENT_CHAR):
                ready, self._pending = self._pending[:cut], self._pending[cut:]
                return ready, text
        return [], ""

    def flush(self) -> tuple[list[int], str]:
        """The stream is over: whatever is still held back, undecodable bytes included, with its text."""
        ready, self._pending = self._pending, []
        return ready, self._tokenizer.decode(ready)


class StopStringFilter:
    """Finds stop strings in streamed text, even when one spans several chunks, so that it is never sent.

    Chunks (token ids with their text, whole characters) come in; whatever could still be the start of a stop
    string is held back. When a stop string appears, the chunks covering the text before it are released with
    the number of characters of their text to keep, since a stop string may begin inside a token.
    """

    def __init__(self, stop_strings: list[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self._held: list[tuple[list[int], str]] = []

    def push(self, token_ids: list[int], text: str) -> tuple[list[int], int | None, bool]:
        """Returns (ids to send, characters of their text to keep or None for all, whether a stop string ended it)."""
        self._held.append((token_ids, text))
        held_text = "".join(t for _, t in self._held)
        found = [held_text.find(s) for s in self.stop_strings if s in held_text]
        if found:
            keep = min(found)
            return self._release(lambda covered, _: covered < keep), keep, True
        # Hold back the longest tail of the text that is the beginning of some stop string.
        partial = max((n for s in self.stop_strings for n in range(1, len(s)) if held_text.endswith(s[:n])),
                      default=0)
        safe = len(held_text) - partial
        return self._release(lambda covered, chunk_text: covered + len(chunk_text) <= safe), None, False

    def flush(self) -> list[int]:
        return self._release(lambda covered, _: True)

    def _release(self, take) -> list[int]:
        released, covered = [], 0
        while self._held and take(covered, self._held[0][1]):
            ids, text = self._held.pop(0)
            released += ids
            covered += len(text)
        return released
