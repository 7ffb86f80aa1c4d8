"""Chat prompts from the checkpoint's own chat template (tokenizer_config.json), as transformers renders them."""

from __future__ import annotations

import json
import os

from jinja2.sandbox import ImmutableSandboxedEnvironment

# GLM-4's template, for checkpoints without one (and for clients that have no copy of the checkpoint).
GLM4_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "observation", "tool")


class ChatTemplate:
    """Turns [{"role": ..., "content": ...}, ...] into the prompt text the model was trained on."""

    def __init__(self, template: str = GLM4_CHAT_TEMPLATE, **special_tokens: str):
        # The environment transformers uses for chat templates: sandboxed, blocks trimmed.
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
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

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for message in messages:
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValueError(f"a chat message is a dict with 'role' and 'content', got {message!r}")
            if message["role"] not in ROLES:
                raise ValueError(f"unknown chat role {message['role']!r}; use one of {', '.join(ROLES)}")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._special_tokens)
