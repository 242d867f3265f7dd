"""Errors that are the caller's mistake: shown as one clear line, never as a traceback."""


class UserError(Exception):
    """Bad input (unknown model, missing file, corrupt weights, ...); the CLI prints it and exits 2."""
