"""The shared core: requests, the paged KV block manager and the token-budget scheduler.

Plain Python only (no torch, simpy, fastapi or pandas): the real engine and the simulator both
drive it through ``schedule(now)`` / ``update_from_output(out, result, now)``.
"""

from twinserve.core.config import SchedulerConfig
from twinserve.core.kv_cache_manager import KVCacheManager
from twinserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from twinserve.core.policy import SchedulingPolicy
from twinserve.core.request import Request, RequestStatus
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler, SchedulerStats, child_request_id

__all__ = [
    "EngineCoreOutput", "KVCacheManager", "ModelRunnerOutput", "Request", "RequestStatus",
    "SamplingParams", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "SchedulerStats", "SchedulingPolicy", "child_request_id",
]
