"""Chat prompts from the checkpoint's own chat template (tokenizer_config.json), as transformers renders them."""

from __future__ import annotations

import json
import os

from jinja2.sandbox import ImmutableSandboxedEnvironment

# GLM-4's chat format, for checkpoints without a template (and clients that have no copy of the checkpoint): each turn
# is <|role|>, then the turn's metadata (an assistant turn's function name, when it calls one), a newline and the
# content; the answer is asked for with a bare <|assistant|>, after which GLM-4 writes either a newline and its text or
# a function name, a newline and the call's JSON arguments. Tools (OpenAI's `tools` list) are described in a system
# turn first, as GLM-4-9B-chat was trained to see them. Newlines after block tags are written as expressions: chat
# templates render with trim_blocks, which drops them.
GLM4_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# 可用工具{% for tool in tools %}"
    "{% set function = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '\\n\\n## ' ~ function['name'] ~ '\\n\\n' }}{{ function | tojson(indent=4) }}\n"
    "在调用上述函数时，请使用 Json 格式表示调用的参数。{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['metadata'] or '' }}\n{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROLES = ("system", "user", "assistant", "observation", "tool")


class ChatTemplate:
    """Turns [{"role": ..., "content": ...}, ...] into the prompt text the model was trained on."""

    def __init__(self, template: str = GLM4_CHAT_TEMPLATE, **special_tokens: str):
        # The environment transformers uses for chat templates: sandboxed, blocks trimmed.
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # transformers' tojson: key order kept, non-ASCII as is (Jinja's own sorts keys and escapes HTML).
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self._template = environment.from_string(template)
        self._special_tokens = special_tokens
        self.source = template

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> "ChatTemplate":
        """The template in model_dir/tokenizer_config.json; GLM-4's when that file has none."""
        path = os.path.join(model_dir, "tokenizer_config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: give the directory of the served checkpoint")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        template = config.get("chat_template") or GLM4_CHAT_TEMPLATE
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {entry["name"]: entry["template"] for entry in template}
            template = named.get("default") or next(iter(named.values()))
        tokens = {name: config[name] for name in ("bos_token", "eos_token") if isinstance(config.get(name), str)}
        return cls(template, **tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """`tools`: OpenAI-style tool definitions, passed to the template as transformers passes them (`tools`); a
        template that reads them from a message instead (GLM-4-9B-chat's own: `item['tools']`) gets them on a leading
        system message without content."""
        for message in messages:
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValueError(f"a chat message is a dict with 'role' and 'content', got {message!r}")
            if message["role"] not in ROLES:
                raise ValueError(f"unknown chat role {message['role']!r}; use one of {', '.join(ROLES)}")
        if tools and "['tools']" in self.source:
            messages = [{"role": "system", "content": "", "tools": tools}, *messages]
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools or None, **self._special_tokens)
