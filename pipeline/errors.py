"""Errors the `dpfm` command reports as one clear line and a non-zero exit, without a traceback."""


class VerificationFailed(RuntimeError):
    """A privacy check of `verify` failed: nothing downstream may publish the model as private."""
