"""tspc: Tensor-and-Sequence Parallelism as a torch.compile backend.

``torch.compile(model, backend="tsp")`` works without importing this package (an entry point
registers the backend); import it for the helpers: match reports and the zigzag layout. Training uses torch's own
machinery: after the first call the model's parameters are DTensors (see docs/training.md).
"""

from tspc.api import load_state_dict, named_parameters, parameters, state_dict
from tspc.errors import (
    FallbackWarning,
    InductorFallbackWarning,
    PartitionerTagError,
    ReleasedWeightsNeededError,
    TSPCompileError,
)
from tspc.generate import GenerateUnsupportedError, enable_generate
from tspc.report import CompileReport, last_report
from tspc.runtime.comm import CollectiveTimeout
from tspc.runtime.errors import SequenceLengthError, TSPConfigError, TSPHeldWholeWarning
from tspc.runtime.optimizers import OptimizerParameterError
from tspc.runtime.rank_check import (
    InputMismatchError,
    ModuleStateMismatchError,
    ProgramMismatchError,
    RanksDisagreeError,
)
from tspc.runtime.release import ReleasedParameterError, is_released
from tspc.runtime.zigzag import zigzag_indices, zigzag_slice, zigzag_unshard

__all__ = [
    "CollectiveTimeout",
    "CompileReport",
    "FallbackWarning",
    "InductorFallbackWarning",
    "GenerateUnsupportedError",
    "enable_generate",
    "InputMismatchError",
    "ModuleStateMismatchError",
    "ProgramMismatchError",
    "RanksDisagreeError",
    "OptimizerParameterError",
    "PartitionerTagError",
    "SequenceLengthError",
    "TSPConfigError",
    "TSPHeldWholeWarning",
    "ReleasedParameterError",
    "ReleasedWeightsNeededError",
    "TSPCompileError",
    "is_released",
    "last_report",
    "load_state_dict",
    "named_parameters",
    "parameters",
    "state_dict",
    "zigzag_indices",
    "zigzag_slice",
    "zigzag_unshard",
]
