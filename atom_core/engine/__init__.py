"""The step-based engine: requests, scheduler, runner (inputs, CUDA graphs), ``Engine``."""

from atom_core.engine.engine import Engine
from atom_core.engine.outputs import RequestOutput, StepOutputs
from atom_core.engine.sampling_params import SamplingParams
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.step import ScheduledStep

__all__ = ["Engine", "RequestOutput", "SamplingParams", "ScheduledStep", "Scheduler", "StepOutputs"]
