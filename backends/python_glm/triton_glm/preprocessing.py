"""`preprocessing`: text_input -> input_ids with the checkpoint's tokenizer (which adds GLM's own prefix)."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from .common import InputError, check_prompt, error_response, internal_error, text_of, tokenizer_and_limit


class Preprocessing:
    def __init__(self, args: dict, parameters: dict[str, str]):
        self.tokenizer, self.max_prompt_tokens = tokenizer_and_limit(parameters, args)
        pad = self.tokenizer.token_id("<|endoftext|>")
        self.pad_id = pad if pad is not None else 0

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            return self._tokenize(request)
        except InputError as exc:
            return error_response(str(exc))
        except Exception:
            return internal_error("tokenizing a prompt")

    def _tokenize(self, request):
        # QUERY is the ensemble's text_input: optional in both configs, so that a request without it gets this
        # error rather than the empty answer Triton's ensemble gives when a required input is missing.
        query = pb_utils.get_input_tensor_by_name(request, "QUERY")
        if query is None:
            raise InputError("input 'text_input' is required")
        texts = [text_of(v, "text_input") for v in query.as_numpy().reshape(-1)]
        for text in texts:
            check_prompt(text, self.tokenizer, self.max_prompt_tokens)
        encoded = self.tokenizer.encode_batch(texts)
        lengths = np.array([[len(ids)] for ids in encoded], dtype=np.int32)
        ids = np.full((len(encoded), int(lengths.max())), self.pad_id, dtype=np.int32)
        for row, seq in enumerate(encoded):
            ids[row, :len(seq)] = seq
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", ids), pb_utils.Tensor("REQUEST_INPUT_LEN", lengths)])

    def finalize(self):
        pass
