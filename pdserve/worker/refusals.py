"""Why a worker does not take a request: each an exception its HTTP server answers with a status."""


class QueueFullError(RuntimeError):
    """The worker's waiting queue is at its bound; try again later or elsewhere."""


class RoleNotServedError(RuntimeError):
    """The request needs a role this worker does not have."""


class EngineBusyError(RuntimeError):
    """The engine thread did not take the request in time (a long step, or it stopped)."""


class DrainingError(RuntimeError):
    """The worker is draining: it finishes what it has and takes nothing new."""
