"""The `python` tool: run the model's code in the sandbox and show it stdout and the error."""

from __future__ import annotations

from typing import Any

from tandem.tools.python_sandbox import PythonSandbox, SandboxLimits
from tandem.tools.registry import ToolResult


class PythonTool:
    """{"code": "..."} -> stdout, plus the error (traceback tail or limit hit) when it failed."""

    name = "python"
    description = ("Run a Python 3 program in a sandbox without network, subprocesses, threads "
                   "or file access outside its working directory; print() what you need to see.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "a Python program"}},
                  "required": ["code"], "additionalProperties": False}

    def __init__(self, sandbox: PythonSandbox | None = None,
                 limits: SandboxLimits = SandboxLimits(), check: bool = True) -> None:
        self.sandbox = sandbox or PythonSandbox(limits)
        if check:
            self.isolation = self.sandbox.probe()  # fail at build time, not mid-rollout

    async def execute(self, arguments: dict[str, Any], context: dict[str, Any]) -> ToolResult:
        """Run arguments["code"]; a failing program is an error result for the model."""
        result = await self.sandbox.run(arguments["code"])
        if result.ok:
            return ToolResult(result.stdout)
        tail = "\n".join(result.stderr.strip().splitlines()[-6:])
        return ToolResult(f"{result.stdout}Error ({result.error}):\n{tail}", ok=False)
