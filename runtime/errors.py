"""Errors a user gets for configurations tspc cannot run (never a fallback, never a hang), and
the warning for what runs but not as the user may believe."""


class TSPConfigError(ValueError):
    """The model, the inputs or the options do not fit the TSP schedules; the message says
    what to change. Raised at compile time on every rank alike."""


class SequenceLengthError(TSPConfigError):
    """The sequence cannot be cut into the 2D zigzag chunks."""


def describe_error(error: BaseException) -> str:
    """``TypeName: first line of the message``: what a report entry or a warning says of an
    exception (a partitioner's message runs to pages)."""
    lines = str(error).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class TSPHeldWholeWarning(UserWarning):
    """A matched attention or MLP runs with (some of) its weights held whole on every rank —
    memory not 1/D — for a reason the user can change (a D that does not fit its heads or its
    intermediate size). Issued once per module per compile; the message names the module, the
    reason and the D values that would shard it."""
