"""OasisKV runtime: an embedded inference engine with dense and sparse (OasisKV) decode modes."""

from oasiskv_runtime.config import EngineConfig, Mode
from oasiskv_runtime.llm import LLM
from oasiskv_runtime.outputs import RequestOutput
from oasiskv_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "Mode"]
__version__ = "0.1.0"
