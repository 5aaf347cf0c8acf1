"""The one error type of the example that is the user's to fix (a flag, a file, a layout): train.py
prints its message alone, without a traceback, and exits with status 2 before doing any work."""


class UsageError(Exception):
    pass
