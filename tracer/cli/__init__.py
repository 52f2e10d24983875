"""The command line: ``commands`` holds the table of commands and the way out of each
(an exit code and one line); each command is a module with ``configure`` and ``run``."""

from .commands import main

__all__ = ["main"]
