"""`python -m planners COMMAND FILE` (see planners/cli.py and PLANNER_SPEC.md)."""
from planners.cli import main

main()
