"""The chat renderer: conversations (OpenAI message format, with tools) -> text -> token ids + loss mask.

It is the only path from conversations to tokens — for SFT, for RL and for the server — and it
exports a Jinja `chat_template` that renders byte-identical text, so that vLLM, SGLang or
`transformers` fed our template produce the same prompt (chat-template drift between SFT, rollout
and serving is a known failure of open stacks; anchors-rl §5.7).

Format: ChatML (SmolLM2's own template for plain messages) with Hermes-style tools:

    <|im_start|>system
    {system}{tools block}<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}
    <tool_call>
    {"name": "read_file", "arguments": {"target_file": "a.py"}}
    </tool_call><|im_end|>
    <|im_start|>tool
    <tool_response>
    {content}
    </tool_response><|im_end|>

The loss mask covers what the assistant generates: its content, tool calls and the closing
`<|im_end|>` — never the headers, the system prompt, user turns or tool results.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from opencomposer.tokenizer.bpe import Tokenizer

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")


class RenderError(ValueError):
    pass


@dataclass(frozen=True)
class TokenSeq:
    """The one thing the trainer consumes: token ids and a 0/1 loss mask of the same length."""

    ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.loss_mask):
            raise ValueError("ids and loss_mask differ in length")


def _args_text(args) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _call_text(tc: dict) -> str:
    fn = tc.get("function", tc)
    return "\n<tool_call>\n{\"name\": " + json.dumps(fn["name"], ensure_ascii=False) + ", \"arguments\": " + \
        _args_text(fn.get("arguments", {})) + "}\n</tool_call>"


class ChatRenderer:
    def __init__(self, tokenizer: Tokenizer | None = None, default_system: str = DEFAULT_SYSTEM):
        self.tokenizer = tokenizer
        self.default_system = default_system

    # -- text ----------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
               add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The prompt text, and the character spans the assistant generated (for the loss mask)."""
        if not messages:
            raise RenderError("no messages")
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = 0

        def emit(s: str) -> None:
            nonlocal pos
            out.append(s)
            pos += len(s)

        msgs = list(messages)
        if msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": self.default_system})
        for i, m in enumerate(msgs):
            role = m.get("role")
            content = m.get("content") or ""
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))  # content parts
            if role == "system":
                if i != 0:
                    raise RenderError("a system message must come first")
                text = content
                if tools:
                    text += TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER
                emit(f"<|im_start|>system\n{text}<|im_end|>\n")
            elif role == "user":
                emit(f"<|im_start|>user\n{content}<|im_end|>\n")
            elif role == "assistant":
                emit("<|im_start|>assistant\n")
                start = pos
                emit(content + "".join(_call_text(tc) for tc in m.get("tool_calls") or []) + "<|im_end|>")
                spans.append((start, pos))
                emit("\n")
            elif role == "tool":
                emit(f"<|im_start|>tool\n<tool_response>\n{content}\n</tool_response><|im_end|>\n")
            else:
                raise RenderError(f"message {i}: unknown role {role!r}")
        if add_generation_prompt:
            emit("<|im_start|>assistant\n")
        return "".join(out), spans

    def encode(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
               add_generation_prompt: bool = False) -> TokenSeq:
        """Token ids of the rendered conversation; loss mask 1 on tokens inside assistant spans."""
        if self.tokenizer is None:
            raise RenderError("no tokenizer")
        text, spans = self.render(messages, tools, add_generation_prompt=add_generation_prompt)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        mask = []
        j = 0
        for s, e in offsets:
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            mask.append(1 if j < len(spans) and spans[j][0] <= s and e <= spans[j][1] else 0)
        return TokenSeq(ids, mask)

    # -- parsing model output --------------------------------------------------------------------
    _CALL = re.compile(r"\n?<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """Split generated text into content and tool calls (OpenAI shape). A malformed call is kept
        with its raw text as `arguments`, so the harness reports it to the model as an error."""
        text = text.split("<|im_end|>", 1)[0]
        calls = []
        for k, m in enumerate(self._CALL.finditer(text)):
            body = m.group(1)
            try:
                obj = json.loads(body)
                name, args = obj["name"], obj.get("arguments", {})
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            except (json.JSONDecodeError, KeyError, TypeError):
                name_m = re.search(r'"name"\s*:\s*"([^"]+)"', body)
                name, args = (name_m.group(1) if name_m else ""), body
            calls.append({"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}})
        content = self._CALL.sub("", text)
        return content, calls

    # -- the Jinja twin --------------------------------------------------------------------------
    def chat_template(self) -> str:
        """A Jinja template that renders exactly `render(...)`'s text (HF's environment:
        trim_blocks, lstrip_blocks, and a `tojson` that keeps non-ASCII and key order)."""
        j = json.dumps
        return (
            "{%- if messages[0]['role'] != 'system' -%}"
            "{{- '<|im_start|>system\\n' + " + j(self.default_system) + " -}}"
            "{%- if tools -%}{{- " + j(TOOLS_HEADER) + " -}}{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}"
            "{%- endfor -%}{{- " + j(TOOLS_FOOTER) + " -}}{%- endif -%}"
            "{{- '<|im_end|>\\n' -}}"
            "{%- endif -%}"
            "{%- for message in messages -%}"
            "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
            "{%- elif message['content'] -%}{%- set content = message['content'] | map(attribute='text') | join('') -%}"
            "{%- else -%}{%- set content = '' -%}{%- endif -%}"
            "{%- if message['role'] == 'system' -%}"
            "{{- '<|im_start|>system\\n' + content -}}"
            "{%- if tools -%}{{- " + j(TOOLS_HEADER) + " -}}{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}"
            "{%- endfor -%}{{- " + j(TOOLS_FOOTER) + " -}}{%- endif -%}"
            "{{- '<|im_end|>\\n' -}}"
            "{%- elif message['role'] == 'user' -%}"
            "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}"
            "{%- elif message['role'] == 'assistant' -%}"
            "{{- '<|im_start|>assistant\\n' + content -}}"
            "{%- for tc in (message['tool_calls'] or []) -%}"
            "{%- set fn = tc['function'] if tc['function'] is defined else tc -%}"
            "{{- '\\n<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
            "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}"
            "{%- endif -%}{{- '}\\n</tool_call>' -}}"
            "{%- endfor -%}"
            "{{- '<|im_end|>\\n' -}}"
            "{%- elif message['role'] == 'tool' -%}"
            "{{- '<|im_start|>tool\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' -}}"
            "{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
        )


def render_jinja(template: str, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                 add_generation_prompt: bool = False) -> str:
    """Render a chat template the way `transformers` does (for tests and for checking a model folder)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(messages=list(messages), tools=list(tools) if tools else None,
                                            add_generation_prompt=add_generation_prompt)
