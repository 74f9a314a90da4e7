"""tide-megatron: asynchronous, elastic RL for multi-turn agentic LLM workloads.

Megatron-core trains, SGLang rolls out, and a pure-Python scheduling core
(`tide_megatron.core`) decides admission, pausing, ref/actor pipelining and rank roles.
"""

__version__ = "0.1.0"
