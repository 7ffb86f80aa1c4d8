"""`postprocessing`: output_ids -> text_output. Each chunk is decoded alone: the glm model only sends chunks that
decode to whole characters, so concatenated chunks equal the whole answer decoded at once."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from glm_engine.tokenizer import GlmTokenizer

from .common import InputError, cut_to_text_length, error_response, internal_error, required_array, resolve_model_dir


class Postprocessing:
    def __init__(self, args: dict, parameters: dict[str, str]):
        self.tokenizer = GlmTokenizer(resolve_model_dir(parameters, args))

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            return self._detokenize(request)
        except InputError as exc:
            return error_response(str(exc))
        except Exception:
            return internal_error("decoding an answer")

    def _detokenize(self, request):
        tokens = required_array(request, "TOKENS_BATCH")  # [batch, beams, tokens]
        lengths = required_array(request, "SEQUENCE_LENGTH")  # [batch, beams]
        if tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
            raise InputError(f"TOKENS_BATCH {list(tokens.shape)} and SEQUENCE_LENGTH {list(lengths.shape)} "
                             "must be [batch, beams, tokens] and [batch, beams]")
        sequences = [tokens[b, k, :lengths[b, k]].tolist()
                     for b in range(tokens.shape[0]) for k in range(tokens.shape[1])]
        texts = self.tokenizer.decode_batch(sequences)
        text_lengths = pb_utils.get_input_tensor_by_name(request, "TEXT_LENGTH")
        if text_lengths is not None:
            limits = text_lengths.as_numpy().reshape(-1).tolist()
            texts = [cut_to_text_length(text, limit) for text, limit in zip(texts, limits)]
        output = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(lengths.shape)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)])

    def finalize(self):
        pass
