"""The step-based engine: requests, scheduler, runner (inputs, CUDA graphs), ``Engine``, the asyncio
``AsyncEngine`` over it, and the worker side of an engine over several ranks."""

from atom_core.engine.async_engine import AsyncEngine
from atom_core.engine.data_parallel import DataParallelEngine, ReplicaFailedError, ReplicaStepError
from atom_core.engine.engine import Engine
from atom_core.engine.outputs import RequestOutput, StepOutputs
from atom_core.engine.sampling_params import SamplingParams, StructuredOutputsParams
from atom_core.engine.sleep_mode import EngineAsleepError
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.step import ScheduledStep
from atom_core.engine.distributed import DistributedEngineError, WorkerFailedError
from atom_core.engine.workers import run_worker

__all__ = ["AsyncEngine", "DataParallelEngine", "DistributedEngineError", "Engine", "EngineAsleepError",
           "ReplicaFailedError",
           "ReplicaStepError", "RequestOutput", "SamplingParams", "ScheduledStep",
           "Scheduler", "StepOutputs", "StructuredOutputsParams", "WorkerFailedError", "run_worker"]
