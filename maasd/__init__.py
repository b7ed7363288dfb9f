"""maasd — memory-as-a-service for LLM inference hosts.

A node-local daemon that reserves QoS-tagged, NUMA-pinned memory pools and
hands tenants isolated, sealed memfd buffers that co-located llama.cpp workers
map zero-copy. See README.md and docs/.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
