"""The checkpoint's tokenizer, and the streaming rule that keeps multi-byte characters whole.

One module used by preprocessing, the output processor and postprocessing, so they can never disagree.
"""

from __future__ import annotations

import functools
import json
import os

from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from .config import CheckpointError

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes, so an unfinished one spans at most the last 3 byte-level tokens.
MAX_UNFINISHED_TOKENS = 3


def same_tokenizer(model_dir: str, other_dir: str) -> bool:
    """Whether two checkpoints tokenize alike: the same tokenizer.json, byte for byte."""
    contents = []
    for directory in (model_dir, other_dir):
        try:
            with open(os.path.join(directory, "tokenizer.json"), "rb") as f:
                contents.append(f.read())
        except OSError:
            raise CheckpointError(f"{directory!r} has no tokenizer.json (a Hugging Face fast tokenizer is required)")
    return contents[0] == contents[1]


def longest_token_bytes(spec: dict) -> int | None:
    """The most bytes of text one token can stand for, for a tokenizer.json (parsed) that turns every byte of a text
    into some token: byte-level BPE, no normalizer, a vocabulary with all 256 byte symbols, pre-tokenizers that split
    without dropping anything (GLM-4's). None for any other: nothing is then known without encoding."""
    model, normalizer, pre = spec.get("model") or {}, spec.get("normalizer"), spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    keeps_every_byte = all(step.get("type") in ("ByteLevel", "Digits") or
                           (step.get("type") == "Split" and step.get("behavior") != "Removed") for step in steps)
    byte_level = any(step.get("type") == "ByteLevel" for step in steps)
    vocab = model.get("vocab")
    if (model.get("type") != "BPE" or normalizer is not None or not isinstance(vocab, dict) or not keeps_every_byte
            or not byte_level or not set(ByteLevel.alphabet()) <= set(vocab)):
        return None
    # A byte-level symbol is one byte; an added token (matched in the text as it is) its UTF-8 length.
    added = [len(token["content"].encode()) for token in spec.get("added_tokens", [])]
    return max([len(symbols) for symbols in vocab] + added)


class GlmTokenizer:
    """A `tokenizer.json` tokenizer. Encoding adds the checkpoint's own prefix (GLM-4: `[gMASK]<sop>`);
    decoding drops special tokens."""

    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"{model_dir!r} has no tokenizer.json (a Hugging Face fast tokenizer is required)")
        self._path = path
        self._tokenizer = Tokenizer.from_file(path)
        # What encoding adds before a prompt: the ids that an empty text encodes to (GLM-4: [gMASK]<sop>).
        self._prefix = self._tokenizer.encode("", add_special_tokens=True).ids

    @functools.cached_property
    def longest_token_bytes(self) -> int | None:
        """longest_token_bytes of this tokenizer.json: read when first asked for, by the models that check prompts
        (the file of a 150,000-token vocabulary takes a while to parse; the others never need it)."""
        with open(self._path, encoding="utf-8") as f:
            return longest_token_bytes(json.load(f))

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, known without encoding it (which takes about a second a
        megabyte): its UTF-8 bytes over the longest token's; 0 where the tokenizer gives no such bound."""
        if not self.longest_token_bytes:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.longest_token_bytes)

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
        # The longest prefix whose text does not end inside a character, holding back at most
        # MAX_UNFINISHED_TOKENS tokens. Cutting there is exact: text that ends on a whole character never changes
        # when more bytes follow.
        shortest = max(1, len(self._pending) - MAX_UNFINISHED_TOKENS)
        for cut in range(len(self._pending), shortest - 1, -1):
            text = self._tokenizer.decode(self._pending[:cut])
            if not text.endswith(REPLACEMENT_CHAR):
                ready, self._pending = self._pending[:cut], self._pending[cut:]
                return ready, text
        return [], ""

    def flush(self) -> tuple[list[int], str]:
        """The stream is over: whatever is still held back, undecodable bytes included, with its text."""
        ready, self._pending = self._pending, []
        return ready, self._tokenizer.decode(ready)
