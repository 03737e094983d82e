"""Errors a user gets for configurations tspc cannot run (never a fallback, never a hang)."""


class TSPConfigError(ValueError):
    """The model, the inputs or the options do not fit the TSP schedules; the message says
    what to change. Raised at compile time on every rank alike."""


class SequenceLengthError(TSPConfigError):
    """The sequence cannot be cut into the 2D zigzag chunks."""
