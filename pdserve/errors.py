"""The failures that cross module (and process) seams, as types: callers tell them apart by class,
never by the words of a message. Plain Python: the router imports these without torch."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer could not be set up or went wrong; the prompt is then recomputed on decode."""


class LayoutMismatch(TransferError):
    """The two workers' KV caches differ in shape or dtype: no backend can move KV between them."""


class ModelMismatch(LayoutMismatch):
    """The two workers serve different models: no KV of one is valid in the other."""


class RegistrationError(ValueError):
    """A worker the router's registry refuses (wrong token, bad role)."""


class OtherModel(RegistrationError):
    """A worker that serves another model than the router's."""
