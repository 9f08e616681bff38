"""wtx: weight sync between RL trainers and inference workers.

Python on top of wtx's C library (libwtx, ctypes): the data plane (shm,
tcp, cuda_ipc, nccl), the trainer engine and the embeddable worker all run
in C; Python passes tensors' memory, never their bytes.

    client = wtx.WorkerClient(["10.0.0.5:50051", "10.0.0.6:50051"], token=...)
    engine = wtx.TrainerEngine.trainer_init(
        wtx.WtxTrainerInitInfo(rank=0, transport="tcp"),
        client=client, source=wtx.TorchModuleSource(model))
    engine.send_weights()          # every RL step
    engine.shutdown()

    with wtx.serve(model, "0.0.0.0:50051"):   # an inference host
        ...
"""
from .client import Tls, WorkerClient, WtxError
from .serve import Server, serve
from .sources import DictSource, ParamMeta, SafetensorsSource, TorchModuleSource
from .trainer import Checksums, TrainerEngine, WtxTrainerInitInfo

__version__ = "0.1.0"
__all__ = ["Checksums", "DictSource", "ParamMeta", "SafetensorsSource", "Server", "Tls",
           "TorchModuleSource", "TrainerEngine", "WorkerClient", "WtxError", "WtxTrainerInitInfo",
           "serve"]
