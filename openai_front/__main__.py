"""python -m openai_front: serve the OpenAI-compatible API in front of a Triton server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from clients import ChatTemplate

from .server import OpenAiFront, serve

API_KEY_ENV = "GLM_OPENAI_API_KEY"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openai_front", description=__doc__.splitlines()[0])
    parser.add_argument("--triton", default="localhost:8001", help="Triton's gRPC address (default localhost:8001)")
    parser.add_argument("--model-dir", default=os.environ.get("GLM_MODEL_DIR", "checkpoints/glm-demo"),
                        help="the served checkpoint, for its chat template (default: GLM_MODEL_DIR or the demo)")
    parser.add_argument("--served-model-name", default="glm", help="the model name clients send (default glm)")
    parser.add_argument("--triton-model", default="ensemble", help="the Triton model requests go to (default ensemble)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9000, help="port (default 9000)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1/ (default: ${API_KEY_ENV}; none: open)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[openai] %(message)s")
    try:
        template = ChatTemplate.from_checkpoint(args.model_dir)
    except (OSError, ValueError) as exc:
        print(f"[openai] cannot read the chat template: {exc}", file=sys.stderr)
        return 2
    front = OpenAiFront(args.triton, template, args.served_model_name, args.api_key, args.triton_model)
    print(f"[openai] http://{args.host}:{args.port}/v1 -> Triton {args.triton} ({args.triton_model}), model "
          f"'{args.served_model_name}', API key {'required' if args.api_key else 'not required'}", flush=True)
    try:
        asyncio.run(serve(front, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
