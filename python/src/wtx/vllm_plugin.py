"""vLLM plugin entry point (group ``vllm.general_plugins``, name ``wtx``):
registers the backend "wtx" in both of vLLM's weight-transfer factories,
lazily (the engines' module is imported when vLLM first creates one).
Installing the package is all it takes; vLLM calls ``register`` in every
process it starts."""
from __future__ import annotations

BACKEND = "wtx"


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # vLLM absent, or too old to have the factories
        return
    for factory, cls in ((WeightTransferEngineFactory, "WtxWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "WtxTrainerWeightTransferEngine")):
        if BACKEND not in factory._registry:  # register() may run more than once
            factory.register_engine(BACKEND, "wtx.vllm_engine", cls)
