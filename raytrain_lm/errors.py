"""User-facing errors: anything the user can fix raises `UserError`; the CLI prints it on one line."""


class UserError(Exception):
    """A problem with the user's input (config, data, paths) rather than a bug in raytrain-lm."""
