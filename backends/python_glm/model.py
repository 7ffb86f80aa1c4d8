"""Triton's entry point for the `python_glm` backend: one TritonPythonModel for every model that names it.

A model's `role` parameter picks the adapter: `preprocessing`, `glm`, `postprocessing`, `bls` or `vllm`. The adapters
are thin (triton_glm/); the work is done by the Triton-free engine package beside them (glm_engine/).
"""

import json
import logging
import os
import sys

# Where nothing is installed (the NGC image), the two packages beside this file are imported from here.
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

from triton_glm.common import model_parameters  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")


def _adapter_class(role: str):
    if role == "preprocessing":
        from triton_glm.preprocessing import Preprocessing
        return Preprocessing
    if role == "postprocessing":
        from triton_glm.postprocessing import Postprocessing
        return Postprocessing
    if role == "glm":
        from triton_glm.glm import GlmEngineModel
        return GlmEngineModel
    if role == "bls":
        from triton_glm.bls import Bls
        return Bls
    if role == "vllm":
        from triton_glm.vllm_style import VllmStyleModel
        return VllmStyleModel
    raise ValueError(f"parameter 'role' must be preprocessing, glm, postprocessing, bls or vllm, got {role!r}")


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(json.loads(args["model_config"]))
        self.adapter = _adapter_class(parameters.pop("role", ""))(args, parameters)

    def execute(self, requests):
        return self.adapter.execute(requests)

    def finalize(self):
        self.adapter.finalize()
