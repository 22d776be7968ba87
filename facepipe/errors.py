"""The one exception family that the CLI turns into a one-line error and a non-zero exit."""


class FacepipeError(Exception):
    """A problem with the user's input or environment, explained in one line."""
