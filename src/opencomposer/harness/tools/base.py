"""Tool plumbing: schemas, argument validation (lenient or strict), dispatch and error capture.

Every failure of a tool call — an unknown tool, arguments that are not JSON, arguments that do not
fit the schema, a path outside the workspace, an edit whose `old_string` is missing — becomes an
observation the model can read and recover from, plus an `error_type` recorded in the trajectory
(the RL reward counts broken tool calls; report §3.7). Nothing a model sends crashes the loop.

Composer determines tools per environment and checks arguments more strictly in training than in
production (report §5): `ToolConfig.disabled` removes tools, `ToolConfig.strict` turns on exact
types, no unknown keys and no empty required strings.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opencomposer.harness.schedule import BARRIER, Access
from opencomposer.sandbox.base import SandboxError, ToolCallError

log = logging.getLogger(__name__)


class ToolError(Exception):
    """A tool refused or failed; the message is what the model sees. `detail`: facts about the
    failure for the trajectory, not shown to the model (a failed edit's matched prefix)."""

    type = "ToolError"

    def __init__(self, message: str, type_: str | None = None, detail: dict | None = None):
        super().__init__(message)
        if type_:
            self.type = type_
        self.detail = detail


class InvalidArguments(ToolError):
    type = "InvalidArguments"


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolConfig:
    disabled: tuple[str, ...] = ()
    """Tools removed from this environment."""
    strict: bool = False
    """Exact argument types, no unknown keys, no empty required strings (training uses this)."""
    max_output_chars: int = 30_000
    """Longer observations keep their head and tail around a truncation marker."""
    read_default_lines: int = 2000
    read_max_bytes: int = 4 << 20
    command_timeout_s: float = 120.0
    shell_session: str = "agent"
    max_results: int = 200
    """Cap on listed files / glob matches / grep lines when the call sets none."""


@dataclass
class ToolContext:
    """What tools act on. One per agent run; tools may run in parallel threads."""

    sandbox: Any
    config: ToolConfig = field(default_factory=ToolConfig)
    index: Any = None
    todos: list[dict] = field(default_factory=list)
    shell_cwd: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    run: Callable[[ToolContext, dict], str]
    access: Callable[[dict], Access] = lambda args: BARRIER
    """What a call with these arguments touches (harness/schedule.py); unknown means everything."""

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolResult:
    content: str
    ok: bool
    error_type: str | None
    duration_s: float
    detail: dict | None = None
    """What the tool recorded about a failure (`ToolError.detail`), for the trajectory only."""


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def validate(schema: dict, args: Any, *, strict: bool, where: str = "arguments") -> dict:
    if not isinstance(args, dict):
        raise InvalidArguments(f"{where} must be a JSON object, got {type(args).__name__}")
    props: dict = schema.get("properties", {})
    out: dict = {}
    for key in schema.get("required", []):
        if key not in args or args[key] is None:
            raise InvalidArguments(f"missing required argument {key!r}")
    for key, value in args.items():
        if key not in props:
            if strict:
                raise InvalidArguments(f"unknown argument {key!r}; expected: {', '.join(props)}")
            continue
        if value is None and key not in schema.get("required", []):
            continue
        out[key] = _check(props[key], value, strict=strict, where=f"{key!r}")
        if strict and key in schema.get("required", []) and out[key] == "" and props[key].get("type") == "string" \
                and not props[key].get("allow_empty"):
            raise InvalidArguments(f"{key!r} must not be empty")
    return out


def _check(spec: dict, value: Any, *, strict: bool, where: str) -> Any:
    t = spec.get("type")
    if t is not None:
        value = _coerce(t, value, strict=strict, where=where)
    if "enum" in spec and value not in spec["enum"]:
        raise InvalidArguments(f"{where} must be one of {spec['enum']}, got {value!r}")
    if t == "array" and "items" in spec:
        value = [_check(spec["items"], v, strict=strict, where=f"{where}[{i}]") for i, v in enumerate(value)]
    if t == "object" and "properties" in spec:
        value = validate(spec, value, strict=strict, where=where)
    if t in ("integer", "number") and "minimum" in spec and value < spec["minimum"]:
        raise InvalidArguments(f"{where} must be >= {spec['minimum']}, got {value}")
    return value


def _coerce(t: str, value: Any, *, strict: bool, where: str) -> Any:
    want = _JSON_TYPES[t]
    if isinstance(value, bool) and t in ("integer", "number"):
        raise InvalidArguments(f"{where} must be {t}, got a boolean")
    if isinstance(value, want):
        return value
    if not strict:  # production leniency: the common near-misses models make
        try:
            if t == "integer" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)
            if t == "integer" and isinstance(value, float) and value.is_integer():
                return int(value)
            if t == "number" and isinstance(value, str):
                return float(value)
            if t == "boolean" and isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if t == "array" and isinstance(value, str):
                return [value]
            if t == "string" and isinstance(value, (int, float)):
                return str(value)
        except ValueError:
            pass
    raise InvalidArguments(f"{where} must be {t}, got {type(value).__name__} {str(value)[:80]!r}")


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters truncated ...]\n{text[-half:]}"


class ToolSet:
    def __init__(self, tools: Sequence[Tool], config: ToolConfig):
        unknown = set(config.disabled) - {t.name for t in tools}
        if unknown:
            raise ValueError(f"cannot disable unknown tools: {sorted(unknown)}")
        self.config = config
        self.tools = {t.name: t for t in tools if t.name not in config.disabled}

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def call(self, ctx: ToolContext, name: str, raw_arguments: str) -> ToolResult:
        t0 = time.perf_counter()

        def fail(kind: str, message: str, detail: dict | None = None) -> ToolResult:
            return ToolResult(f"Error ({kind}): {message}", False, kind, time.perf_counter() - t0, detail)

        tool = self.tools.get(name)
        if tool is None:
            return fail("UnknownTool", f"no tool named {name!r}; available: {', '.join(self.tools)}")
        try:
            args = json.loads(raw_arguments) if raw_arguments and raw_arguments.strip() else {}
        except (json.JSONDecodeError, TypeError) as e:
            return fail("MalformedArguments", f"arguments are not valid JSON ({e}); send a JSON object")
        try:
            args = validate(tool.parameters, args, strict=self.config.strict)
            out = tool.run(ctx, args)
        except ToolError as e:
            return fail(e.type, str(e), e.detail)
        except ToolCallError as e:
            return fail(e.type, e.message)
        except SandboxError as e:
            return fail("SandboxError", str(e))
        except Exception as e:  # noqa: BLE001 - a tool bug must not end the episode
            log.exception("tool %s crashed", name)
            return fail("InternalError", f"{type(e).__name__}: {e}")
        return ToolResult(truncate(out, self.config.max_output_chars), True, None, time.perf_counter() - t0)
