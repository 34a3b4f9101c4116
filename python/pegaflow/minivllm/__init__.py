"""A vLLM-shaped engine in PyTorch that drives a KV connector in vLLM's own call order.

No vLLM can be installed where PegaFlow is built and tested, so this package replicates the
parts of vLLM a `KVConnectorBase_V1` observes: requests with chained block hashes
(`request`), the block pool and prefix cache (`kv_cache_manager`), the scheduler loop
(`scheduler`), the worker's per-step connector order (`model_runner`), a Llama model over
vLLM's paged KV layout (`llama`, `attention`) and the engine joining them (`engine`).
It proves behaviour against vLLM's published contract, not compatibility with vLLM's objects.
"""

from pegaflow.minivllm.engine import EngineConfig, LLMEngine
from pegaflow.minivllm.llama import CONFIGS, LlamaConfig, LlamaModel
from pegaflow.minivllm.request import Request

__all__ = ["CONFIGS", "EngineConfig", "LLMEngine", "LlamaConfig", "LlamaModel", "Request"]
