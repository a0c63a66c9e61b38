"""User-facing errors.

Every error a person can cause (bad model name, corrupt file, impossible request) is raised as a
YggdrasilError whose message says what is wrong and what to do. The CLI prints the message and
exits non-zero without a traceback.
"""


class YggdrasilError(Exception):
    """An error caused by input or environment, with a message meant for the user."""

    exit_code = 2


class ModelNotFoundError(YggdrasilError):
    """The model name is unknown, or a known default model is not installed."""


class ModelFileError(YggdrasilError):
    """A model file is missing, truncated, corrupt or fails its checksum."""


class UnsupportedModelError(YggdrasilError):
    """The model's architecture or tensor format is not one we implement."""


class InvalidRequestError(YggdrasilError):
    """Bad generation parameters: sampling values, lengths beyond the context."""
