"""Planner input errors: one line naming the field."""


class PlannerInputError(ValueError):
    """Invalid planner input; `field` is the JSON path of the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
