"""One exception type for mistakes a user can fix; the CLI prints it as one line, no traceback."""
from __future__ import annotations

import re
from typing import Mapping


class UserError(Exception):
    """Bad input: names the file/field/node and what was expected. `param`: the library parameter
    (a build option, a spec field) the message starts with, so a caller can name it its own way
    (the CLI's flag, the spec's JSON path)."""

    def __init__(self, message: str, *, param: str | None = None, mentions: tuple[str, ...] = ()):
        super().__init__(message)
        self.param = param
        self.mentions = tuple(mentions)  # other parameters the message names (e.g. valid options)

    def naming(self, names: Mapping[str, str]) -> str:
        """The message with its leading parameter name and the parameters it mentions replaced
        by their `names`."""
        text = str(self)
        if self.param is not None and self.param in names and text.startswith(self.param):
            text = names[self.param] + text[len(self.param):]
        for p in self.mentions:
            if p in names:
                text = re.sub(rf"(?<![\w-]){re.escape(p)}(?![\w-])", names[p], text)
        return text


def as_typed(text: str) -> str:
    """`text` as the user typed it, for a message; its repr when it is empty, has edge spaces or
    unprintable characters, which would not show (or would break the line) as typed."""
    return text if text and text.isprintable() and text == text.strip() else repr(text)
