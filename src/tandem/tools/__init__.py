"""Tools the model can call from the tool-calling loop: registry, calculator, Python sandbox."""

from tandem.tools.registry import (Tool, ToolRegistry, ToolResult, build_tool_registry,
                                   builtin_tool_names, tool_schema, validate_arguments)

__all__ = ["Tool", "ToolRegistry", "ToolResult", "build_tool_registry", "builtin_tool_names",
           "tool_schema", "validate_arguments"]
