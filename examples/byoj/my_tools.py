"""A tool of the user's own: two-number arithmetic, following tandem's Tool contract."""

import operator

from tandem import Tool, ToolResult

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class Arithmetic(Tool):
    name = "calculator"
    description = "Compute 'a + b', 'a - b' or 'a * b' for whole numbers a and b."
    parameters = {"type": "object", "required": ["expression"],
                  "properties": {"expression": {"type": "string"}}}
    calls = 0  # how often the model called it (the test reads this)

    async def execute(self, arguments, context):
        type(self).calls += 1
        parts = arguments["expression"].split()
        if len(parts) != 3 or parts[1] not in OPERATORS:
            return ToolResult("Error: write 'a + b', 'a - b' or 'a * b'", ok=False)
        try:
            a, b = int(parts[0]), int(parts[2])
        except ValueError:
            return ToolResult("Error: a and b must be whole numbers", ok=False)
        return ToolResult(str(OPERATORS[parts[1]](a, b)))
