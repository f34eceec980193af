"""Errors that mean "the input is wrong": printed by the CLI as one line naming the cause."""


class UserError(ValueError):
    """A problem with the user's input (config, paths, options, checkpoints)."""
