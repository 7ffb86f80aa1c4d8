"""The one definition of what a request to the Triton models carries: every input of the ensemble and bls
(TensorRT-LLM's names, plus vllm_backend's), the name each has on the glm model, the key it has in vllm_backend's
`sampling_parameters` JSON, and every output.

The adapters read requests through it (request_params.py, bls.py), a test holds the models' config.pbtxt files and
the client SDK's request builder against it, and the tables in docs/requests.md are printed from it:

    python -m triton_glm.request_schema

An input that sets a SamplingParams field takes that field's default and rule (glm_engine/sampling_params.py).
Plain Python: importable without Triton.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from glm_engine.sampling_params import RULES, SamplingParams

SAMPLING_DEFAULTS = {field.name: field.default for field in dataclasses.fields(SamplingParams)}


@dataclass(frozen=True)
class Tensor:
    """An input or output. `datatype` is the KServe / Triton type (STRING travels as BYTES); `dims` exclude the
    batch dimension."""

    name: str
    datatype: str
    meaning: str
    dims: tuple[int, ...] = (1,)
    # The SamplingParams field (or RULES key) this input sets: its default and rule come from there.
    setting: str | None = None
    default: str = ""  # in words, for an input that sets no SamplingParams field (or overrides its default)
    rule: str = ""  # in words, likewise
    glm_name: str | None = None  # its name on the glm model, where that differs
    json_key: str | None = None  # its key in vllm_backend's sampling_parameters JSON
    # For an input of TensorRT-LLM's that asks for something this engine does not do: whether a value (a numpy array)
    # changes nothing and is accepted; any other is refused with `rule`.
    accepts: Callable | None = None

    @property
    def glm_input(self) -> str:
        return self.glm_name or self.name

    def default_text(self) -> str:
        if self.default or self.setting not in SAMPLING_DEFAULTS:
            return self.default
        value = SAMPLING_DEFAULTS[self.setting]
        return f"{value:g}" if isinstance(value, float) else str(value)

    def rule_text(self) -> str:
        if self.rule or self.setting not in RULES:
            return self.rule
        return "must " + RULES[self.setting].describe()


def _switch(name: str, meaning: str) -> Tensor:
    return Tensor(name, "BOOL", meaning, default="false")


def _unsupported(name: str, datatype: str, feature: str, dims: tuple[int, ...] = (1,), default: str = "none",
                 rule: str = "must be empty", accepts: Callable = lambda value: value.size == 0) -> Tensor:
    """An input of TensorRT-LLM's for `feature`, which this engine does not have: its default is accepted (clients
    send it), anything else refused."""
    return Tensor(name, datatype, f"not supported: {feature}", dims=dims, default=default, rule=rule, accepts=accepts)


def _all(test: Callable) -> Callable:
    return lambda value: all(test(v) for v in value.reshape(-1))


def _no_text(value) -> bool:
    return all(not (v.strip() if isinstance(v, (bytes, str)) else v) for v in value.reshape(-1))


# The inputs of the ensemble and bls, in the order of their config.pbtxt. Only text_input is required.
REQUEST_INPUTS = (
    Tensor("text_input", "STRING", "the prompt", default="required", rule="not blank"),
    Tensor("max_tokens", "INT32", "tokens to generate; the prompt plus max_tokens must fit `max_model_len`",
           setting="max_tokens", default="`default_max_tokens` (64)", glm_name="request_output_len",
           json_key="max_tokens"),
    Tensor("stream", "BOOL", "one response per few tokens (ensemble only)", default="false", glm_name="streaming"),
    Tensor("exclude_input_in_output", "BOOL", "a single response repeats the prompt text before the answer unless "
           "this is true (as in TensorRT-LLM); streams never repeat it", default="false"),
    Tensor("temperature", "FP32", "0 (or anything below 1e-5) is greedy", setting="temperature",
           json_key="temperature"),
    Tensor("top_k", "INT32", "0 turns it off; 1 is greedy (in the JSON, -1 turns it off too)", setting="top_k",
           glm_name="runtime_top_k", json_key="top_k"),
    Tensor("top_p", "FP32", "1 turns it off (so does 0 in the tensor, as in TensorRT-LLM)", setting="top_p",
           glm_name="runtime_top_p", json_key="top_p"),
    Tensor("seed", "UINT64", "the same seed and prompt give the same text, whatever else is in the batch; the "
           "random draws do not depend on the device", setting="seed", default="drawn per request",
           json_key="seed"),
    Tensor("min_p", "FP32", "drops tokens less likely than min_p times the most likely one", setting="min_p",
           json_key="min_p"),
    Tensor("repetition_penalty", "FP32", "above 1 discourages tokens already in the prompt or output",
           setting="repetition_penalty", json_key="repetition_penalty"),
    Tensor("presence_penalty", "FP32", "subtracted once from the logits of tokens already generated",
           setting="presence_penalty", json_key="presence_penalty"),
    Tensor("frequency_penalty", "FP32", "subtracted once per earlier occurrence in the output",
           setting="frequency_penalty", json_key="frequency_penalty"),
    Tensor("min_tokens", "INT32", "end-of-sequence tokens cannot end the answer before this many tokens",
           setting="min_tokens", json_key="min_tokens"),
    Tensor("end_id", "INT32", "a single stop token that replaces them; never returned",
           default="the checkpoint's eos ids", rule="a token id"),
    Tensor("ignore_eos", "BOOL", "generate exactly `max_tokens`, whatever is sampled (benchmarks)", default="false",
           json_key="ignore_eos"),
    Tensor("stop_words", "STRING", "strings that end the answer; found even when they span several tokens, and "
           "never returned (`finish_reason` `stop`)", dims=(-1,), setting="stop", default="none", json_key="stop"),
    Tensor("bad_words", "STRING", "words never to generate: their tokens (with and without a leading space) are "
           "banned where they would complete the word", dims=(-1,), setting="bad_words", default="none",
           json_key="bad_words"),
    _switch("return_log_probs", "fill `output_log_probs` / `cum_log_probs`"),
    Tensor("sampling_parameters", "STRING", "vllm_backend's request style: the settings as a JSON object, whose "
           "values may be strings (see below)", default="none", rule="a JSON object of the keys below"),
    _switch("return_logprobs", "vllm_backend's switch: turns log-probs on"),
    _switch("return_cumulative_logprob", "vllm_backend's switch: turns log-probs on"),
    _switch("return_finish_reason", "vllm_backend's switch: accepted; `finish_reason` is always present"),
    _switch("return_num_input_tokens", "vllm_backend's switch: accepted; `num_input_tokens` is always present"),
    _switch("return_num_output_tokens", "vllm_backend's switch: accepted; `num_output_tokens` is always present"),
    Tensor("pad_id", "INT32", "accepted for TensorRT-LLM clients; outputs are never padded", default="none"),
    Tensor("num_return_sequences", "INT32", "answers to the prompt, each with its `sequence_index`, sharing the "
           "prompt's KV blocks; the ensemble sends each answer's responses (bls: only 1)", setting="n",
           json_key="n"),
    Tensor("min_length", "INT32", "TensorRT-LLM's older name for `min_tokens`", setting="min_tokens"),
    Tensor("random_seed", "UINT64", "TensorRT-LLM's older name for `seed`", setting="seed"),
    _switch("return_perf_metrics", "fill the KV-cache and timing outputs (`kv_cache_*`, `*_time_ns`)"),
    _switch("return_kv_cache_reuse_stats", "TensorRT-LLM's older switch: fill the `kv_cache_*` outputs"),
    # TensorRT-LLM's inputs for what this engine does not do; its clients send some of them with values that change
    # nothing.
    _unsupported("beam_width", "INT32", "beam search", default="1", rule="must be 1",
                 accepts=_all(lambda v: v == 1)),
    Tensor("length_penalty", "FP32", "beam search only: changes nothing here", default="1", rule="must be finite",
           accepts=_all(math.isfinite)),
    _switch("early_stopping", "beam search only: changes nothing here"),
    _unsupported("return_context_logits", "BOOL", "the prompt's logits", default="false", rule="must be false",
                 accepts=_all(lambda v: not v)),
    _unsupported("return_generation_logits", "BOOL", "the logits of each new token (ask for log-probs instead)",
                 default="false", rule="must be false", accepts=_all(lambda v: not v)),
    _unsupported("num_draft_tokens", "INT32", "speculative decoding", default="0", rule="must be 0",
                 accepts=_all(lambda v: v == 0)),
    _unsupported("use_draft_logits", "BOOL", "speculative decoding", default="false", rule="must be false",
                 accepts=_all(lambda v: not v)),
    _unsupported("embedding_bias_words", "STRING", "a bias on words' logits", dims=(-1,), accepts=_no_text),
    _unsupported("embedding_bias_weights", "FP32", "a bias on words' logits", dims=(-1,)),
    _unsupported("prompt_embedding_table", "FP16", "prompt tuning", dims=(-1, -1)),
    _unsupported("prompt_table_extra_id", "UINT64", "prompt tuning", rule="must be 0",
                 accepts=_all(lambda v: v == 0)),
    _unsupported("prompt_vocab_size", "INT32", "prompt tuning", rule="must be 0", accepts=_all(lambda v: v == 0)),
    _unsupported("lora_task_id", "UINT64", "LoRA adapters", rule="must be 0", accepts=_all(lambda v: v == 0)),
    _unsupported("lora_weights", "FP16", "LoRA adapters", dims=(-1, -1)),
    _unsupported("lora_config", "INT32", "LoRA adapters", dims=(-1, 3)),
    _unsupported("guided_decoding_guide_type", "STRING", "guided decoding", rule="must be empty", accepts=_no_text),
    _unsupported("guided_decoding_guide", "STRING", "guided decoding", rule="must be empty", accepts=_no_text),
    _unsupported("decoder_text_input", "STRING", "encoder-decoder models' decoder input", rule="must be empty",
                 accepts=_no_text),
)

# Keys of sampling_parameters that no tensor input has.
JSON_ONLY_KEYS = {
    "stop_token_ids": "a list of token ids that end the answer, in place of the checkpoint's eos ids",
    "logprobs": "above 0 turns log-probs on",
}

# The glm model's own inputs, besides those it shares with the ensemble (under their glm names).
GLM_ONLY_INPUTS = (
    Tensor("input_ids", "INT32", "the prompt's token ids (required but for a `stop` request)", dims=(-1,)),
    Tensor("input_lengths", "INT32", "how many of input_ids are the prompt"),
    Tensor("stop", "BOOL", "TensorRT-LLM's stop: ends the running requests that have this request's id "
           "(finish_reason `cancelled`)", default="false"),
)

# Every response of the ensemble and bls carries these (on a stream, each counts what has been sent so far).
REQUEST_OUTPUTS = (
    Tensor("text_output", "STRING", "the text (a piece of it, when streaming)", dims=(-1,)),
    Tensor("finish_reason", "STRING", "`stop` (an end-of-sequence token or stop word), `length` (max_tokens), "
           "`cancelled` (a `stop` request) or `error`; empty until the last response"),
    Tensor("num_input_tokens", "INT32", "prompt tokens"),
    Tensor("num_output_tokens", "INT32", "tokens generated so far"),
    Tensor("output_log_probs", "FP32", "with log-probs on, each new token's log-probability under the model (after "
           "penalties, before temperature and filters); left out otherwise (no response carries an empty output)",
           dims=(-1, -1)),
    Tensor("cum_log_probs", "FP32", "with log-probs on, their sum; 0 otherwise", dims=(-1,)),
    Tensor("glm_version", "INT32", "the version of the `glm` model that produced the response (docs/versions.md)"),
    Tensor("sequence_index", "INT32", "which of the `num_return_sequences` answers the response belongs to (from 0)"),
    Tensor("batch_index", "INT32", "which prompt of the request the response answers: always 0 (one prompt per "
           "request)"),
    # With return_perf_metrics (the kv_cache_* ones with return_kv_cache_reuse_stats too): TensorRT-LLM's figures.
    Tensor("kv_cache_alloc_new_blocks", "INT32", "KV blocks the request computed (not found in the prefix cache)"),
    Tensor("kv_cache_reused_blocks", "INT32", "KV blocks of the prompt found in the prefix cache"),
    Tensor("kv_cache_alloc_total_blocks", "INT32", "KV blocks the request held at most"),
    Tensor("arrival_time_ns", "INT64", "when glm received the request (Unix time, ns)"),
    Tensor("first_scheduled_time_ns", "INT64", "when it first joined the running batch"),
    Tensor("first_token_time_ns", "INT64", "when its first token was generated"),
    Tensor("last_token_time_ns", "INT64", "when its latest token was generated"),
    Tensor("acceptance_rate", "FP32", "speculative decoding's: always 0"),
    Tensor("total_accepted_draft_tokens", "INT32", "speculative decoding's: always 0"),
    Tensor("total_draft_tokens", "INT32", "speculative decoding's: always 0"),
    # Declared so that TensorRT-LLM's clients can name them; never sent, as their switches must be false.
    Tensor("context_logits", "FP32", "never sent (`return_context_logits` must be false)", dims=(-1, -1)),
    Tensor("generation_logits", "FP32", "never sent (`return_generation_logits` must be false)", dims=(-1, -1, -1)),
)

# The glm model sends the text (the ensemble's), its token ids (postprocessing decodes them the same way), and the
# rest as is.
GLM_OUTPUTS = (
    REQUEST_OUTPUTS[0],
    Tensor("output_ids", "INT32", "token ids: a chunk that decodes to whole characters; left out of a response "
           "without any (e.g. a stream's last)", dims=(-1, -1)),
    Tensor("sequence_length", "INT32", "how many output_ids", dims=(-1,)),
    Tensor("text_length", "INT32", "characters of their text to keep (a stop string began inside); -1: all",
           dims=(-1,)),
    *REQUEST_OUTPUTS[1:],
)

INPUTS_BY_NAME = {tensor.name: tensor for tensor in REQUEST_INPUTS}


def markdown_tables() -> str:
    """The tables of docs/requests.md."""
    lines = ["| input | type | default | rule | meaning |", "|---|---|---|---|---|"]
    for tensor in REQUEST_INPUTS:
        datatype = tensor.datatype + (" [-1]" if tensor.dims == (-1,) else "")
        lines.append(f"| `{tensor.name}` | {datatype} | {tensor.default_text()} | {tensor.rule_text()} | "
                     f"{tensor.meaning} |")
    lines += ["", "| `sampling_parameters` key | same as input | meaning |", "|---|---|---|"]
    for tensor in REQUEST_INPUTS:
        if tensor.json_key:
            lines.append(f"| `{tensor.json_key}` | `{tensor.name}` | |")
    lines += [f"| `{key}` | | {meaning} |" for key, meaning in JSON_ONLY_KEYS.items()]
    lines += ["", "| output | type | meaning |", "|---|---|---|"]
    lines += [f"| `{tensor.name}` | {tensor.datatype} | {tensor.meaning} |" for tensor in REQUEST_OUTPUTS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_tables(), end="")
