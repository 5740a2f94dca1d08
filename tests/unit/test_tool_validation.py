from __future__ import annotations

import pytest

from opencomposer.harness.tools import ALL_TOOLS, ToolConfig, build_toolset
from opencomposer.harness.tools.base import InvalidArguments, truncate, validate

SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string"}, "n": {"type": "integer", "minimum": 1}, "flag": {"type": "boolean"},
    "mode": {"type": "string", "enum": ["a", "b"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "string"}},
                                         "required": ["id"]}}},
    "required": ["path"]}


def test_lenient_coerces_common_near_misses():
    out = validate(SCHEMA, {"path": "x", "n": "3", "flag": "true", "extra": 1}, strict=False)
    assert out == {"path": "x", "n": 3, "flag": True}


@pytest.mark.parametrize("args,msg", [
    ({"path": "x", "n": "3"}, "must be integer"),
    ({"path": "x", "extra": 1}, "unknown argument"),
    ({"path": ""}, "must not be empty"),
    ({"path": "x", "flag": "true"}, "must be boolean"),
])
def test_strict_rejects(args, msg):
    with pytest.raises(InvalidArguments, match=msg):
        validate(SCHEMA, args, strict=True)


@pytest.mark.parametrize("args,msg", [
    ({}, "missing required argument 'path'"),
    ({"path": "x", "n": 0}, ">= 1"),
    ({"path": "x", "mode": "c"}, "one of"),
    ({"path": "x", "items": [{"nope": 1}]}, "missing required argument 'id'"),
    ({"path": "x", "n": True}, "got a boolean"),
    ([1, 2], "JSON object"),
])
def test_both_modes_reject(args, msg):
    for strict in (False, True):
        with pytest.raises(InvalidArguments, match=msg):
            validate(SCHEMA, args, strict=strict)


def test_toolset_selection_and_schemas():
    ts = build_toolset(ToolConfig(disabled=("codebase_search", "todo_write")))
    names = {s["function"]["name"] for s in ts.schemas()}
    assert "codebase_search" not in names and "read_file" in names and len(names) == len(ALL_TOOLS) - 2
    with pytest.raises(ValueError, match="unknown tools"):
        build_toolset(ToolConfig(disabled=("nope",)))
    for s in build_toolset().schemas():  # every schema is well-formed OpenAI function-calling JSON
        f = s["function"]
        assert s["type"] == "function" and f["parameters"]["type"] == "object"
        assert set(f["parameters"].get("required", [])) <= set(f["parameters"]["properties"])


def test_harness_config_enables_only_named_tools():
    from opencomposer.core.errors import UserError
    from opencomposer.harness.agent import harness_config

    cfg = harness_config(("read_file", "grep"), max_turns=3, max_wall_s=5.0)
    names = {s["function"]["name"] for s in build_toolset(cfg.tools).schemas()}
    assert names == {"read_file", "grep"} and cfg.max_turns == 3 and cfg.max_wall_s == 5.0
    assert len(build_toolset(harness_config((), 3, 5.0).tools).schemas()) == len(ALL_TOOLS)
    with pytest.raises(UserError, match=r"unknown tool\(s\) \['nope'\]"):
        harness_config(("read_file", "nope"), 3, 5.0)


def test_dispatch_errors_without_a_sandbox():
    from opencomposer.harness.tools import ToolContext

    ts = build_toolset()
    ctx = ToolContext(sandbox=None)
    assert ts.call(ctx, "nope", "{}").error_type == "UnknownTool"
    assert ts.call(ctx, "read_file", "{bad").error_type == "MalformedArguments"
    assert ts.call(ctx, "read_file", '{"offset": 2}').error_type == "InvalidArguments"
    r = ts.call(ctx, "codebase_search", '{"query": "x"}')
    assert not r.ok and r.error_type == "Unavailable"


def test_truncate_marks_the_cut():
    t = truncate("a" * 100 + "b" * 100, 50)
    assert t.startswith("a" * 25) and t.endswith("b" * 25) and "150 characters truncated" in t
