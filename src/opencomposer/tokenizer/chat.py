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


_ARGS_KEY = re.compile(r'"arguments"\s*:\s*')


def _raw_arguments(body: str, parsed) -> str:
    """The arguments exactly as the model wrote them (spacing, key order, escapes), not a
    re-serialisation: what the harness and the next prompt see is what was sampled."""
    dec = json.JSONDecoder()
    for m in _ARGS_KEY.finditer(body):
        try:
            value, end = dec.raw_decode(body, m.end())
        except json.JSONDecodeError:
            continue
        if value == parsed:
            return body[m.end():end]
    return json.dumps(parsed, ensure_ascii=False)


class ChatRenderer:
    def __init__(self, tokenizer: Tokenizer | None = None, default_system: str = DEFAULT_SYSTEM):
        self.tokenizer = tokenizer
        self.default_system = default_system

    # -- text ----------------------------------------------------------------------------------
    def _pieces(self, messages: Sequence[dict], tools: Sequence[dict] | None, add_generation_prompt: bool,
                use_ids: bool) -> list[tuple[str, object, bool]]:
        """The conversation as (kind, value, trainable) pieces: "tmpl" is the template's own text
        (it may hold control tokens), "data" is text from users, tools, files or the model (always
        encoded as plain text), "ids" are an assistant turn's recorded sampled ids (`use_ids`)."""
        if not messages:
            raise RenderError("no messages")
        out: list[tuple[str, object, bool]] = []
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
                out += [("tmpl", "<|im_start|>system\n", False), ("data", content, False)]
                if tools:
                    out += [("tmpl", TOOLS_HEADER, False),
                            ("data", "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools), False),
                            ("tmpl", TOOLS_FOOTER, False)]
                out.append(("tmpl", "<|im_end|>\n", False))
            elif role == "user":
                out += [("tmpl", "<|im_start|>user\n", False), ("data", content, False), ("tmpl", "<|im_end|>\n", False)]
            elif role == "assistant":
                out.append(("tmpl", "<|im_start|>assistant\n", False))
                ids = (m.get("opencomposer") or {}).get("token_ids") if use_ids else None
                if ids is not None:
                    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                        raise RenderError(f"message {i}: opencomposer.token_ids must be a list of ints")
                    out.append(("ids", list(ids), True))
                    end = self.tokenizer.eos_id if self.tokenizer is not None else None
                    # A turn cut at max_tokens has no end-of-turn id: close it for the next prompt,
                    # outside the loss (the model never produced it).
                    out.append(("tmpl", "<|im_end|>\n" if not ids or ids[-1] != end else "\n", False))
                    continue
                out.append(("data", content, True))
                for tc in m.get("tool_calls") or []:
                    fn = tc.get("function", tc)
                    out += [("tmpl", "\n<tool_call>\n", True), ("data", "{\"name\": " + json.dumps(fn["name"], ensure_ascii=False)
                                                                   + ", \"arguments\": " + _args_text(fn.get("arguments", {}))
                                                                   + "}", True), ("tmpl", "\n</tool_call>", True)]
                out += [("tmpl", "<|im_end|>", True), ("tmpl", "\n", False)]
            elif role == "tool":
                out += [("tmpl", "<|im_start|>tool\n<tool_response>\n", False), ("data", content, False),
                        ("tmpl", "\n</tool_response><|im_end|>\n", False)]
            else:
                raise RenderError(f"message {i}: unknown role {role!r}")
        if add_generation_prompt:
            out.append(("tmpl", "<|im_start|>assistant\n", False))
        return out

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
               add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The prompt text, and the character spans the assistant generated (for the loss mask)."""
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for _, value, train in self._pieces(messages, tools, add_generation_prompt, use_ids=False):
            if train and value:
                if spans and spans[-1][1] == pos:
                    spans[-1] = (spans[-1][0], pos + len(value))
                else:
                    spans.append((pos, pos + len(value)))
            parts.append(value)
            pos += len(value)
        return "".join(parts), spans

    def encode(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
               add_generation_prompt: bool = False) -> TokenSeq:
        """Token ids of the conversation; loss mask 1 on what the assistant generated.

        Tokens are the contract: text from users, tools and files is encoded as plain text (a
        `<|im_end|>` in a tool result is bytes, never an end-of-turn id, so repository content
        cannot forge a role boundary), and an assistant turn that carries its sampled ids
        (`opencomposer.token_ids`) is spliced in as those ids. Control tokens come only from the
        template. For text without special literals this equals encoding the rendered text whole:
        the tokenizer splits at special tokens before anything else, and so do we."""
        if self.tokenizer is None:
            raise RenderError("no tokenizer")
        tok = self.tokenizer
        specials, split = self._specials()
        ids: list[int] = []
        mask: list[int] = []
        region: list[tuple[str, bool]] = []

        def flush() -> None:
            text = "".join(t for t, _ in region)
            if text:
                bounds, pos = [], 0
                for t, train in region:
                    bounds.append((pos, pos + len(t), train))
                    pos += len(t)
                got, offsets = tok.encode_plain(text)
                for tid, (a, b) in zip(got, offsets):
                    ids.append(tid)
                    # Trainable only if every character of the token is (as a span test on the text).
                    over = [train for lo, hi, train in bounds if lo < max(b, a + 1) and a < hi]
                    mask.append(int(bool(over) and all(over)))
            region.clear()

        for kind, value, train in self._pieces(messages, tools, add_generation_prompt, use_ids=True):
            if kind == "ids":
                flush()
                ids.extend(value)
                mask.extend([1] * len(value))
            elif kind == "tmpl" and split is not None:
                for part in split.split(value):
                    if part in specials:
                        flush()
                        ids.append(specials[part])
                        mask.append(int(train))
                    elif part:
                        region.append((part, train))
            else:
                region.append((value, train))
        flush()
        return TokenSeq(ids, mask)

    def _specials(self) -> tuple[dict[str, int], re.Pattern | None]:
        """The tokenizer's added tokens and a pattern that splits template text at them (made once:
        the server encodes every request with it)."""
        if getattr(self, "_special_cache", None) is None:
            specials = self.tokenizer.added_tokens()
            split = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")") \
                if specials else None
            self._special_cache = (specials, split)
        return self._special_cache

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
                args = args if isinstance(args, str) else _raw_arguments(body, args)
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
