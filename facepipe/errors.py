"""The one exception family that the CLI turns into a one-line error and a non-zero exit."""


class FacepipeError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ForeignFileError(FacepipeError):
    """A file in another tool's format (an insightface ``.bin`` set, an IJB folder) that is damaged,
    malformed or holds more than plain data; the message names the file and what is wrong."""
