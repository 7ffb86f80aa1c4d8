"""The tokenizer module, the streaming chunker that keeps characters whole, and the demo checkpoint builder."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_engine import EngineConfig, LLMEngine, SamplingParams
from glm_engine.tokenizer import REPLACEMENT_CHAR, CompleteTextChunker, GlmTokenizer, longest_token_bytes

CHINESE = "模型的输出被逐个词元地发送给客户端，后处理必须保证每一段文本都是完整的字符。龘靐齉"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return GlmTokenizer(demo_model_dir)


def test_prompt_gets_glm_prefix_and_decodes_back(tokenizer):
    ids = tokenizer.encode("Hello 世界")
    assert ids[:2] == [tokenizer.token_id("[gMASK]"), tokenizer.token_id("<sop>")]
    assert tokenizer.decode(ids) == "Hello 世界"


def test_a_prompt_that_already_has_the_prefix_does_not_get_a_second(tokenizer):
    chat_prompt = "[gMASK]<sop><|user|>\nhi<|assistant|>"  # what GLM-4's chat template renders
    ids = tokenizer.encode(chat_prompt)
    assert ids == tokenizer.encode(chat_prompt, add_special_tokens=False)
    assert ids[:2] == [tokenizer.token_id("[gMASK]"), tokenizer.token_id("<sop>")] and ids[2:4] != ids[:2]
    assert tokenizer.encode_batch([chat_prompt, "hi"]) == [ids, tokenizer.encode("hi")]


def test_streamed_chunks_decode_alone_to_the_whole_text(tokenizer):
    ids = tokenizer.encode(CHINESE)[2:]
    # The rare characters are not in the vocabulary: their UTF-8 bytes are split across tokens.
    assert any(tokenizer.decode([t]).endswith(REPLACEMENT_CHAR) for t in ids)
    naive = "".join(tokenizer.decode([t]) for t in ids)
    assert naive != CHINESE  # decoding each token alone garbles it (TensorRT-LLM backend issue #332)

    chunker = CompleteTextChunker(tokenizer)
    pushed = [chunker.push([t]) for t in ids] + [chunker.flush()]
    chunks = [chunk for chunk, _ in pushed]
    texts = [tokenizer.decode(chunk) for chunk in chunks if chunk]
    assert [text for chunk, text in pushed if chunk] == texts  # the text it reports is the chunk's own
    assert "".join(texts) == CHINESE
    assert not any(REPLACEMENT_CHAR in text for text in texts)
    assert sum(len(chunk) for chunk in chunks) == len(ids)


def test_undecodable_bytes_are_released_at_the_end(tokenizer):
    lone_lead_byte = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == REPLACEMENT_CHAR][0]
    chunker = CompleteTextChunker(tokenizer)
    assert chunker.push([lone_lead_byte]) == ([], "")
    assert chunker.flush() == ([lone_lead_byte], REPLACEMENT_CHAR)


def test_demo_model_is_deterministic_and_matches_transformers(demo_model_dir, tmp_path):
    from glm_tools.demo_model import build_demo_model
    from transformers import Glm4ForCausalLM

    again = build_demo_model(str(tmp_path / "again"))
    for name in sorted(os.listdir(demo_model_dir)):
        assert filecmp.cmp(os.path.join(demo_model_dir, name), os.path.join(again, name), shallow=False), name

    prompt = GlmTokenizer(demo_model_dir).encode("用中文讲一个故事")
    engine = LLMEngine(EngineConfig(model_dir=demo_model_dir, num_kv_blocks=32))
    ours = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=()))[0]
    model = Glm4ForCausalLM.from_pretrained(demo_model_dir).eval()
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == reference


SPECIALS = ["<|user|>", "<|assistant|>", "[gMASK]", "<sop>", "<|endoftext|>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(SPECIALS + ["#" * 80, " " * 30, CHINESE, "🦜"])),
                max_size=20))
def test_fewest_tokens_never_exceeds_the_tokens_a_text_encodes_to(tokenizer, pieces):
    text = "".join(pieces)
    assert tokenizer.fewest_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))


def test_fewest_tokens_is_the_bytes_over_the_longest_token(tokenizer):
    assert tokenizer.longest_token_bytes == 80  # the demo vocabulary's 80 '#'
    assert tokenizer.fewest_tokens("#" * 80) == 1 and tokenizer.fewest_tokens("#" * 81) == 2
    assert tokenizer.fewest_tokens(CHINESE) == -(-len(CHINESE.encode()) // 80)


@pytest.mark.parametrize("change", [
    lambda spec: spec.update(normalizer={"type": "NFKC"}),  # may shorten the text before it is split
    lambda spec: spec["model"].update(type="Unigram"),
    lambda spec: spec["model"]["vocab"].pop("Ġ"),  # a byte without a symbol of its own is dropped
    lambda spec: spec.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}),
    lambda spec: spec.update(pre_tokenizer={"type": "Whitespace"}),
])
def test_no_bound_for_a_tokenizer_that_may_drop_bytes(demo_model_dir, change):
    with open(os.path.join(demo_model_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    assert longest_token_bytes(spec) == 80
    change(spec)
    assert longest_token_bytes(spec) is None
