"""One exception type for mistakes a user can fix; the CLI prints it as one line, no traceback."""


class UserError(Exception):
    """Bad input: names the file/field/node and what was expected."""
