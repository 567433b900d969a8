"""The one error type users see for input that cannot work."""


class PlanError(ValueError):
    """A plan, SPEC, model or artifact that cannot work, with the reason and a fix.

    The message is one line: what is wrong (naming the value), why, and what to do.
    The CLI prints it without a traceback and exits with status 2.
    """


class Terminated(KeyboardInterrupt):
    """The launcher got SIGTERM; its ranks have been stopped. The CLI exits with 143."""
