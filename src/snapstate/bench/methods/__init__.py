"""Checkpointing methods compared by the harness: one module per framework, one registry.

Importing this package registers every method. Framework modules import their framework only
inside methods, so the registry (names, MethodInfo) is readable from any environment; a
method runs in its framework's environment (``snapstate.bench.frameworks``).
"""

from snapstate.bench.methods import (
    chainer_methods,
    lightning_methods,
    peer_methods,
    tf_methods,
    torch_methods,
)
from snapstate.bench.methods.registry import (
    METHODS,
    BenchTrainer,
    Method,
    MethodInfo,
    Pending,
    get_method,
    method_names,
    register,
)

__all__ = [
    "METHODS",
    "BenchTrainer",
    "Method",
    "MethodInfo",
    "Pending",
    "chainer_methods",
    "lightning_methods",
    "peer_methods",
    "get_method",
    "method_names",
    "register",
    "tf_methods",
    "torch_methods",
]
