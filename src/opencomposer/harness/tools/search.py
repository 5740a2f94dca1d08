"""Search tools: grep (ripgrep, inside the sandbox) and codebase_search (the host-side index)."""

from __future__ import annotations

from opencomposer.harness.schedule import Access
from opencomposer.harness.tools.base import Tool, ToolContext, ToolError
from opencomposer.harness.tools.files import _rg


def grep(ctx: ToolContext, a: dict) -> str:
    # Sorted output: the same repository state always gives the same observation (reproducible
    # rollouts and evals), at the cost of ripgrep's parallel directory walk.
    args = ["--sort=path", "--no-heading", "--line-number", "--max-columns=500", "--max-columns-preview"]
    mode = a.get("output_mode", "content")
    if mode == "files_with_matches":
        args = ["--sort=path", "-l"]
    elif mode == "count":
        args = ["--sort=path", "-c"]
    if a.get("case_insensitive"):
        args.append("-i")
    if a.get("multiline"):
        args += ["-U", "--multiline-dotall"]
    if mode == "content":
        for key, flag in (("context_before", "-B"), ("context_after", "-A"), ("context", "-C")):
            if a.get(key):
                args += [flag, str(a[key])]
    if a.get("glob"):
        args += ["-g", a["glob"]]
    if a.get("type"):
        args += ["-t", a["type"]]
    args += ["-e", a["pattern"]]
    if a.get("path") not in (None, "", ".", "./"):
        args += ["--", a["path"]]
    r = _rg(ctx, args)
    if r.exit_code == 1 or not r.stdout.strip():
        return "No matches found."
    lines = r.stdout.splitlines()
    if mode == "files_with_matches":
        lines.sort()
    limit = a.get("head_limit") or ctx.config.max_results
    out = "\n".join(lines[:limit])
    if len(lines) > limit:
        out += f"\n[... {len(lines) - limit} more lines; narrow the search or raise head_limit]"
    return out


def codebase_search(ctx: ToolContext, a: dict) -> str:
    if ctx.index is None:
        raise ToolError("codebase_search is not available in this environment (no index)", "Unavailable")
    hits = ctx.index.search(a["query"], dirs=a.get("target_directories") or None, k=a.get("max_results") or 8)
    if not hits:
        return "No relevant code found."
    parts = []
    for h in hits:
        body = "\n".join(f"{i:6}|{line}" for i, line in enumerate(h.text.splitlines(), start=h.start))
        parts.append(f"{h.path}:{h.start}-{h.end} (score {h.score:.2f})\n{body}")
    return "\n\n".join(parts)


TOOLS = [
    Tool("grep", "Search file contents with a regular expression (ripgrep syntax; .gitignore respected). "
         "output_mode: content (matching lines with line numbers), files_with_matches, or count.",
         {"type": "object", "properties": {
             "pattern": {"type": "string"},
             "path": {"type": "string", "description": "File or directory to search (default: workspace root)."},
             "glob": {"type": "string", "description": "Only files matching this glob, e.g. '*.py'."},
             "type": {"type": "string", "description": "ripgrep file type, e.g. py, js, rust."},
             "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
             "context_before": {"type": "integer", "minimum": 0},
             "context_after": {"type": "integer", "minimum": 0},
             "context": {"type": "integer", "minimum": 0},
             "case_insensitive": {"type": "boolean"},
             "multiline": {"type": "boolean"},
             "head_limit": {"type": "integer", "minimum": 1}},
          "required": ["pattern"]}, grep, lambda a: Access(reads=(a.get("path") or ".",))),
    Tool("codebase_search", "Find code relevant to a natural-language or identifier query, ranked by relevance. "
         "Use it to locate where something is implemented before reading files.",
         {"type": "object", "properties": {
             "query": {"type": "string"},
             "target_directories": {"type": "array", "items": {"type": "string"}},
             "max_results": {"type": "integer", "minimum": 1}},
          "required": ["query"]}, codebase_search,
         lambda a: Access(reads=tuple(a.get("target_directories") or ["."]))),
]
