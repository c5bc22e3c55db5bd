"""Errors a user can cause. Each carries a plain one-line message and an exit code;
the CLI and the HTTP edge catch them once and print the message, never a traceback."""


class MawError(Exception):
    exit_code = 2


class FormatError(MawError):
    """A model file or pack is missing, truncated, malformed or unsupported."""


class UnsupportedError(FormatError):
    """An architecture or quant type MawForge does not handle."""


class PackExists(MawError):
    """Refusing to overwrite an existing pack without --force."""


class IntegrityError(MawError):
    """A digest did not match: the pack is damaged."""
    exit_code = 3


class BudgetRejected(MawError):
    """The planner rejected the configuration (a result, given its own exit code)."""
    exit_code = 4


class RequestError(MawError):
    """A request the engine cannot serve (empty prompt, over the context, bad parameter)."""


class ContextLengthError(RequestError):
    """A request whose tokens do not fit the context (OpenAI's `context_length_exceeded`)."""
    code = "context_length_exceeded"


class Cancelled(MawError):
    """A request cancelled while its prompt ran (the client went away, or the server is stopping):
    the run stops at the next layer or piece; nothing it half-wrote is kept."""
    code = "cancelled"
