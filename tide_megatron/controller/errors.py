"""The error that stops a run from rank 0's rollout side.

Its own module because every part of the rollout side raises it (the service thread, its
group bookkeeping, its rank hand-over) while the main thread catches it: the parts must not
import the service that wires them.
"""


class RunError(RuntimeError):
    """The run cannot go on; the message says why."""
