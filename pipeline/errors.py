"""One exception type for mistakes a user can fix; the CLI prints it as one line, no traceback."""
from __future__ import annotations

from typing import Mapping


class UserError(Exception):
    """Bad input: names the file/field/node and what was expected. `param`: the library parameter
    (a build option, a spec field) the message starts with, so a caller can name it its own way
    (the CLI's flag, the spec's JSON path)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param

    def naming(self, names: Mapping[str, str]) -> str:
        """The message with its leading parameter name replaced by `names[param]`."""
        text = str(self)
        if self.param in names and text.startswith(self.param):
            return names[self.param] + text[len(self.param):]
        return text
