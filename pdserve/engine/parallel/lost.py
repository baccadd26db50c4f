"""What a tensor-parallel rank raises when another rank of its worker is gone."""


class RanksLost(RuntimeError):
    """Another rank of this worker is gone: the worker cannot compute a step without it."""
