"""Errors a user gets for configurations tspc cannot run (never a fallback, never a hang), and
the warning for what runs but not as the user may believe."""


class TSPConfigError(ValueError):
    """The model, the inputs or the options do not fit the TSP schedules; the message says
    what to change. Raised at compile time on every rank alike."""


class SequenceLengthError(TSPConfigError):
    """The sequence cannot be cut into the 2D zigzag chunks."""


class TSPHeldWholeWarning(UserWarning):
    """A matched attention or MLP runs with (some of) its weights held whole on every rank —
    memory not 1/D — for a reason the user can change (a D that does not fit its heads or its
    intermediate size). Issued once per module per compile; the message names the module, the
    reason and the D values that would shard it."""
