"""The agent's tools, Cursor-style, each executed inside the sandbox through its tool server.

One implementation serves the CLI agent, evals and RL rollouts (report §5: "a shared tool library
invoked over RPC"); `build_toolset(ToolConfig(...))` gives an environment its own selection.
"""

from __future__ import annotations

from opencomposer.harness.tools import files, search, shell
from opencomposer.harness.tools.base import Tool, ToolConfig, ToolContext, ToolResult, ToolSet

ALL_TOOLS: list[Tool] = [*files.TOOLS, *search.TOOLS, *shell.TOOLS]


def build_toolset(config: ToolConfig | None = None) -> ToolSet:
    return ToolSet(ALL_TOOLS, config or ToolConfig())


__all__ = ["ALL_TOOLS", "Tool", "ToolConfig", "ToolContext", "ToolResult", "ToolSet", "build_toolset"]
