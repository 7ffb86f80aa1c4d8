"""Chat: OpenAI messages and tools to a GLM-4 prompt, and GLM-4's answers back to OpenAI's message (content or
tool_calls).

GLM-4 calls a function by answering `name\\n{json arguments}` after `<|assistant|>`, and reads the result in an
`<|observation|>` turn. So an OpenAI assistant message with tool_calls becomes one assistant turn per call (the name
as the turn's metadata, the arguments as its content), and a `tool` message becomes an observation turn.
"""

from __future__ import annotations

import json
import uuid

from clients.chat import ChatTemplate

from .protocol import ApiError, Generation, invalid, sampling_keywords, stream_options, text_of_content

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "observation"}


def glm_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    turns = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        role = ROLES[role]
        content = text_of_content(message.get("content"), f"{where}.content")
        calls = message.get("tool_calls") or [] if role == "assistant" else []
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", "must be a list")
        if content or not calls:
            turns.append({"role": role, "content": content})
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise invalid(f"{where}.tool_calls", "must be a list of {\"function\": {\"name\", \"arguments\"}}")
            arguments = function.get("arguments") or "{}"
            turns.append({"role": "assistant", "metadata": function["name"],
                          "content": arguments if isinstance(arguments, str) else json.dumps(arguments)})
    return turns


def tool_settings(body: dict) -> tuple[list[dict], str | None]:
    """(the tools the prompt describes, the function the answer must call or None) from `tools` and `tool_choice`."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" and
                                              isinstance(t.get("function"), dict) and
                                              isinstance(t["function"].get("name"), str) for t in tools):
        raise invalid("tools", "must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none":
        return [], None
    if choice in ("auto", "required"):  # "required" cannot be enforced without guided decoding: treated as auto
        return tools, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid("tool_choice", f"names the function {name!r}, which is not in 'tools'")
    return tools, name


def chat_generation(body: dict, template: ChatTemplate) -> Generation:
    sampling, n = sampling_keywords(body, "max_completion_tokens")
    stream, include_usage = stream_options(body)
    tools, forced = tool_settings(body)
    try:
        prompt = template.render(glm_messages(body.get("messages")), tools=tools)
    except ApiError:
        raise
    except Exception as exc:  # a template error: the messages do not fit the checkpoint's template
        raise invalid("messages", f"cannot be rendered by the model's chat template: {exc}") from None
    if forced:
        prompt += forced + "\n"  # the answer starts inside the call: its arguments
    top_logprobs = body.get("top_logprobs")
    if top_logprobs:
        raise invalid("top_logprobs", "must be 0 or absent: this server reports only the chosen tokens' log-probs")
    logprobs = bool(body.get("logprobs"))
    sampling["return_log_probs"] = logprobs or None
    return Generation([prompt], sampling, n, stream, include_usage, logprobs, tools, forced)


def tool_calls_in(text: str, tools: list[dict], forced: str | None) -> list[dict] | None:
    """The calls an answer makes, in OpenAI's form, or None if it is plain text. GLM-4 writes a call as the function's
    name, a newline and JSON arguments; a forced call (tool_choice naming a function) is all arguments. Arguments that
    are not JSON are passed on as they are for a forced call (without guided decoding nothing guarantees JSON), and
    make the answer plain text otherwise."""
    if forced is not None:
        return [_call(forced, text.strip())]
    names = {tool["function"]["name"] for tool in tools}
    name, newline, arguments = text.strip().partition("\n")
    if not newline or name.strip() not in names:
        return None
    try:
        json.loads(arguments)
    except ValueError:
        return None
    return [_call(name.strip(), arguments.strip())]


def might_become_a_call(text: str, tools: list[dict]) -> bool:
    """Whether a streamed answer so far could still turn out to be a call (its first line a tool's name, or the
    start of one): such text is held back until the answer is complete."""
    if not tools:
        return False
    first_line, newline, _ = text.lstrip().partition("\n")
    names = [tool["function"]["name"] for tool in tools]
    return any(name == first_line.strip() if newline else name.startswith(first_line) for name in names)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
