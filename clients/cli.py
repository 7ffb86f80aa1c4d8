"""The command line: python -m clients {generate,stream,chat,health} [options]. See clients/README.md."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import ChatTemplate, GlmError, connect
from .request import SAMPLING_INPUTS

# Options the CLI sets itself rather than as flags.
NOT_FLAGS = ("exclude_input_in_output",)


def sampling_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per sampling input (--max-tokens, --temperature, ..., --stop-words A --stop-words B)."""
    group = parser.add_argument_group("sampling (the server's defaults when left out)")
    for name, (datatype, dtype) in SAMPLING_INPUTS.items():
        if name in NOT_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        if datatype == "BOOL":
            group.add_argument(flag, dest=name, action="store_true", default=None)
        elif datatype == "BYTES":
            group.add_argument(flag, dest=name, action="append", metavar="TEXT", help="may be repeated")
        else:
            group.add_argument(flag, dest=name, type=float if datatype == "FP32" else int)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    common.add_argument("--url", help="server address (default localhost:8001 for gRPC, localhost:8000 for HTTP)")
    common.add_argument("--model", default="ensemble", help="model to ask (default ensemble; bls also works)")
    common.add_argument("--model-version", default="", help="model version (default: the server's policy)")
    common.add_argument("--timeout", type=float, help="seconds for a whole request (default: no limit)")

    parser = argparse.ArgumentParser(prog="python -m clients", description="Talk to Open-AutoGLM on Triton.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "print the whole answer to a prompt"),
                            ("stream", "print the answer to a prompt as it is generated")):
        command = commands.add_parser(name, parents=[common], help=help_text)
        command.add_argument("prompt")
        command.add_argument("--json", action="store_true", help="print the answer and its figures as JSON")
        sampling_flags(command)
    chat = commands.add_parser("chat", parents=[common], help="an interactive chat that keeps its history")
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument("--checkpoint", help="directory of the served checkpoint, for its chat template "
                                           "(default: GLM-4's template)")
    sampling_flags(chat)
    commands.add_parser("health", parents=[common], help="is the server live and ready, is the model ready")
    return parser


def sampling_of(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SAMPLING_INPUTS
            if name not in NOT_FLAGS and getattr(args, name) is not None}


def run(args: argparse.Namespace) -> int:
    options = {"model": args.model, "model_version": args.model_version, "timeout": args.timeout}
    if getattr(args, "checkpoint", None):
        options["chat_template"] = ChatTemplate.from_checkpoint(args.checkpoint)
    with connect(args.url, args.protocol, **options) as client:
        if args.command == "health":
            status = client.health()
            print(json.dumps({"url": client.url, "protocol": args.protocol, "model": args.model, **status}))
            return 0 if all(status.values()) else 1
        if args.command == "generate":
            started = time.monotonic()
            generation = client.generate(args.prompt, **sampling_of(args))
            if args.json:
                print(json.dumps({**generation.__dict__, "seconds": round(time.monotonic() - started, 3)},
                                 ensure_ascii=False))
            else:
                print(generation.text)
                usage(generation, started)
            return 0
        if args.command == "stream":
            return stream(client, args)
        return chat(client, args)


def stream(client, args: argparse.Namespace) -> int:
    started = time.monotonic()
    first_token = None
    with client.stream(args.prompt, **sampling_of(args)) as pieces:
        for text in pieces:
            first_token = first_token or time.monotonic()
            if args.json:
                print(json.dumps({"text": text}, ensure_ascii=False), flush=True)
            else:
                print(text, end="", flush=True)
    if args.json:
        print(json.dumps(pieces.generation.__dict__, ensure_ascii=False))
    else:
        print()
        usage(pieces.generation, started, first_token)
    return 0


def chat(client, args: argparse.Namespace) -> int:
    """Reads a message per line; /reset forgets the history, /exit or end of input quits."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        print("glm> ", end="", flush=True)
        with client.stream_chat(messages, **sampling_of(args)) as pieces:
            for text in pieces:
                print(text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": pieces.generation.text})


def usage(generation, started: float, first_token: float | None = None) -> None:
    elapsed = time.monotonic() - started
    ttft = f", first text after {first_token - started:.2f} s" if first_token else ""
    print(f"[{generation.finish_reason}: {generation.num_input_tokens} prompt + {generation.num_output_tokens} "
          f"generated tokens in {elapsed:.2f} s{ttft}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except GlmError as exc:
        print(f"error ({type(exc).__name__}): {exc.message}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, FileNotFoundError) as exc:  # a bad option, message or template path
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the stream's cancellation has run by now
        print("\n[cancelled]", file=sys.stderr)
        return 130
