"""ctypes declarations of libwtx's public C API (include/wtx/*.h).

Every struct mirrors its C definition field by field; the package's tests
compare their sizes and offsets with the compiler's (tests/python/abi_probe).
Nothing here is public: the rest of the package wraps it.
"""
from __future__ import annotations

import ctypes as C
import os
from pathlib import Path

MAX_DIMS = 8
MAX_VERSION_BYTES = 256


def _load() -> C.CDLL:
    path = os.environ.get("WTX_LIBWTX") or str(Path(__file__).parent / "_lib" / "libwtx.so")
    try:
        return C.CDLL(path)
    except OSError as e:
        raise ImportError(f"wtx: cannot load libwtx ({path}): {e}; reinstall the package "
                          "(pip install ./python) or set WTX_LIBWTX") from e


lib = _load()


class TensorMeta(C.Structure):
    _fields_ = [("name", C.c_char_p), ("dtype", C.c_int), ("shape", C.c_uint64 * MAX_DIMS),
                ("ndim", C.c_size_t), ("nbytes", C.c_uint64)]


class ClientOptions(C.Structure):
    _fields_ = [("timeout_ms", C.c_int64), ("retries", C.c_int), ("token", C.c_char_p),
                ("tls_ca_pem", C.c_char_p), ("tls_cert_pem", C.c_char_p),
                ("tls_key_pem", C.c_char_p)]


class TrainerConfig(C.Structure):
    _fields_ = [("rank", C.c_uint32), ("backend", C.c_char_p), ("unpacked", C.c_int),
                ("buffer_size", C.c_uint64), ("num_buffers", C.c_uint32),
                ("checksum", C.c_int), ("timeout_ms", C.c_uint32),
                ("data_address", C.c_char_p), ("direct", C.c_int), ("world", C.c_uint32),
                ("rank_addresses", C.POINTER(C.c_char_p)), ("session_token", C.c_char_p),
                ("delta", C.c_int)]


PROGRESS = C.CFUNCTYPE(None, C.c_void_p, C.c_uint64, C.c_uint64)


class SendOptions(C.Structure):
    _fields_ = [("version", C.c_char_p), ("target", C.c_int), ("progress", PROGRESS),
                ("progress_arg", C.c_void_p)]


class SendResult(C.Structure):
    _fields_ = [("bytes", C.c_uint64), ("params", C.c_size_t), ("chunks", C.c_size_t),
                ("seconds", C.c_double), ("version", C.c_char * (MAX_VERSION_BYTES + 1)),
                ("xxh3", C.POINTER(C.c_uint64)), ("direct", C.c_int),
                ("control_bytes", C.c_uint64), ("delta", C.c_int),
                ("skipped_params", C.c_size_t), ("skipped_bytes", C.c_uint64),
                ("full_reason", C.c_char_p), ("patched_params", C.c_size_t),
                ("patched_whole_bytes", C.c_uint64)]


class Patch(C.Structure):
    _fields_ = [("name", C.c_char_p), ("dtype", C.c_int), ("shape", C.POINTER(C.c_uint64)),
                ("ndim", C.c_size_t), ("index_dtype", C.c_int), ("count", C.c_uint64),
                ("indices", C.c_void_p), ("values", C.c_void_p)]


# wtx_source_ops
SRC_METADATA = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.POINTER(TensorMeta)),
                           C.POINTER(C.c_size_t))
SRC_OPEN = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_void_p))
SRC_NEXT = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.POINTER(TensorMeta),
                       C.POINTER(C.c_void_p))
SRC_CLOSE = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p)
SRC_DESTROY = C.CFUNCTYPE(None, C.c_void_p)
# next_batch's arrays as plain addresses: the adapter fills them by slices
SRC_NEXT_BATCH = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p,
                             C.c_void_p, C.c_void_p)


class Ownership(C.Structure):
    """wtx_ownership: which trainer ranks own a parameter, and how."""
    _fields_ = [("owners", C.POINTER(C.c_uint32)), ("n_owners", C.c_size_t),
                ("mesh_shape", C.POINTER(C.c_uint32)), ("mesh_ndim", C.c_size_t),
                ("placements", C.POINTER(C.c_int32))]


PLACEMENT_REPLICATE = -1
# wtx_source_ops.ownership: an array of Ownership, one per metadata entry.
SRC_OWNERSHIP = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.POINTER(Ownership)),
                            C.POINTER(C.c_size_t))


# The ops structs' layouts this package was written for (WTX_*_OPS_VERSION).
SOURCE_OPS_VERSION = 1
MODEL_OPS_VERSION = 2
CONTROL_OPS_VERSION = 2


class SourceOps(C.Structure):
    _fields_ = [("version", C.c_uint), ("name", C.c_char_p), ("metadata", SRC_METADATA), ("open", SRC_OPEN),
                ("next", SRC_NEXT), ("close", SRC_CLOSE), ("destroy", SRC_DESTROY),
                ("next_batch", SRC_NEXT_BATCH), ("ownership", SRC_OWNERSHIP)]


# wtx_model_ops
M_CHECK = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.POINTER(TensorMeta), C.c_void_p,
                      C.c_size_t)
M_BEGIN = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int)
M_STAGE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.POINTER(C.c_void_p))
M_LOADED = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.POINTER(C.c_uint64))
M_PREPARE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_char_p, C.c_void_p, C.c_size_t)
M_COMMIT = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_char_p)
M_ABORT = C.CFUNCTYPE(None, C.c_void_p)
M_STAGE_DEVICE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.c_int,
                             C.POINTER(C.c_void_p))
M_ADOPT_DEVICE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.c_int,
                             C.c_void_p)


M_CHECK_CHUNK = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.POINTER(TensorMeta), C.c_size_t,
                            C.POINTER(C.c_size_t), C.c_void_p, C.c_size_t)
M_STAGE_CHUNK = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.c_size_t,
                            C.POINTER(C.c_void_p))
M_LOADED_CHUNK = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.c_size_t,
                             C.POINTER(C.c_uint64))
M_CHECK_RANGE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.c_uint64, C.c_size_t,
                            C.POINTER(TensorMeta), C.c_size_t, C.POINTER(C.c_size_t),
                            C.c_void_p, C.c_size_t)
M_REVERT = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.c_void_p, C.c_size_t)
M_READ = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.POINTER(TensorMeta), C.c_void_p,
                     C.c_void_p, C.c_size_t)
M_ADOPT_CHUNK = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(TensorMeta), C.c_size_t,
                            C.POINTER(C.c_void_p))


class ModelOps(C.Structure):
    _fields_ = [("version", C.c_uint), ("check", M_CHECK), ("begin", M_BEGIN), ("stage", M_STAGE),
                ("loaded", M_LOADED), ("prepare", M_PREPARE), ("commit", M_COMMIT),
                ("abort", M_ABORT), ("stage_device", M_STAGE_DEVICE),
                ("adopt_device", M_ADOPT_DEVICE), ("check_chunk", M_CHECK_CHUNK),
                ("stage_chunk", M_STAGE_CHUNK), ("loaded_chunk", M_LOADED_CHUNK),
                ("check_range", M_CHECK_RANGE), ("revert", M_REVERT), ("read", M_READ),
                ("adopt_chunk", M_ADOPT_CHUNK)]


ON_PAUSE = C.CFUNCTYPE(None, C.c_void_p, C.c_int)
ON_RESUME = C.CFUNCTYPE(None, C.c_void_p)


class WorkerOptions(C.Structure):
    _fields_ = [("listen", C.c_char_p), ("backends", C.POINTER(C.c_char_p)),
                ("n_backends", C.c_size_t), ("model_ops", C.POINTER(ModelOps)),
                ("model", C.c_void_p), ("world_size", C.c_uint32), ("watchdog_ms", C.c_int64),
                ("max_message_bytes", C.c_int), ("on_pause", ON_PAUSE),
                ("on_resume", ON_RESUME), ("host", C.c_void_p), ("model_spec", C.c_char_p),
                ("publish_dir", C.c_char_p), ("publish_keep", C.c_int),
                ("token_file", C.c_char_p), ("tls_cert_pem", C.c_char_p),
                ("tls_key_pem", C.c_char_p), ("tls_client_ca_pem", C.c_char_p),
                ("reflection", C.c_int), ("max_calls", C.c_int),
                ("max_model_bytes", C.c_uint64), ("max_params", C.c_uint64),
                ("allow_upstream", C.c_char_p), ("vllm_url", C.c_char_p),
                ("vllm_dir", C.c_char_p), ("vllm_pause_mode", C.c_char_p),
                ("vllm_disk", C.c_int), ("vllm_timeout_ms", C.c_int64),
                ("metrics_listen", C.c_char_p), ("relay_port", C.c_int),
                ("cuda_device", C.c_char_p), ("shard_rules", C.c_char_p),
                ("tp_rank", C.c_uint32), ("tp_size", C.c_uint32)]


# wtx_control_ops
C_INIT = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p, C.c_size_t)
C_START = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.c_void_p, C.c_size_t)
C_UPDATE = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p, C.c_size_t)
C_FINISH = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_char_p, C.c_void_p, C.c_size_t)
C_ABORT = C.CFUNCTYPE(None, C.c_void_p, C.c_char_p)


class ControlOps(C.Structure):
    _fields_ = [("version", C.c_uint), ("init", C_INIT), ("start", C_START), ("update", C_UPDATE),
                ("finish", C_FINISH), ("abort", C_ABORT), ("patches", C.c_int)]


STRUCTS = {"wtx_control_ops": ControlOps, "wtx_tensor_meta": TensorMeta, "wtx_client_options": ClientOptions,
           "wtx_trainer_config": TrainerConfig, "wtx_send_options": SendOptions, "wtx_patch": Patch,
           "wtx_send_result": SendResult, "wtx_source_ops": SourceOps,
           "wtx_ownership": Ownership,
           "wtx_model_ops": ModelOps, "wtx_worker_options": WorkerOptions}

P = C.c_void_p
ERRBUF = 2048


def _fn(name: str, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


strerror = _fn("wtx_strerror", C.c_char_p, C.c_int)
err_to_grpc = _fn("wtx_err_to_grpc", C.c_int, C.c_int)
client_create = _fn("wtx_client_create", C.c_int, C.POINTER(C.c_char_p), C.c_size_t,
                    C.POINTER(ClientOptions), C.POINTER(P), C.c_char_p, C.c_size_t)
client_destroy = _fn("wtx_client_destroy", None, P)
client_create_control = _fn("wtx_client_create_control", C.c_int, C.POINTER(ControlOps), P,
                            C.POINTER(P))
client_last_error = _fn("wtx_client_last_error", C.c_char_p, P)
source_create = _fn("wtx_source_create", C.c_int, C.POINTER(SourceOps), P, C.POINTER(P))
source_destroy = _fn("wtx_source_destroy", None, P)
source_safetensors = _fn("wtx_source_safetensors", C.c_int, C.POINTER(C.c_char_p), C.c_size_t,
                         C.POINTER(P), C.c_char_p, C.c_size_t)
source_metadata = _fn("wtx_source_metadata", C.c_int, P, C.POINTER(C.POINTER(TensorMeta)),
                      C.POINTER(C.c_size_t))
trainer_init = _fn("wtx_trainer_init", C.c_int, C.POINTER(TrainerConfig), P, P, C.POINTER(P),
                   C.c_char_p, C.c_size_t)
trainer_send = _fn("wtx_trainer_send_weights", C.c_int, P, C.POINTER(SendOptions),
                   C.POINTER(SendResult))
trainer_send_patches = _fn("wtx_trainer_send_patches", C.c_int, P, C.POINTER(Patch), C.c_size_t,
                           C.POINTER(SendOptions), C.POINTER(SendResult))
trainer_last_error = _fn("wtx_trainer_last_error", C.c_char_p, P)
trainer_shutdown = _fn("wtx_trainer_shutdown", None, P)
worker_start = _fn("wtx_worker_start", C.c_int, C.POINTER(WorkerOptions), C.POINTER(P),
                   C.c_char_p, C.c_size_t)
worker_port = _fn("wtx_worker_port", C.c_int, P)
worker_drain = _fn("wtx_worker_drain", None, P, C.c_int64)
worker_destroy = _fn("wtx_worker_destroy", None, P)
worker_set_serving = _fn("wtx_worker_set_serving", None, P, C.c_int)
tensor_meta_set = _fn("wtx_tensor_meta_set", C.c_int, C.POINTER(TensorMeta), C.c_char_p,
                      C.c_int, C.POINTER(C.c_uint64), C.c_size_t, C.c_char_p, C.c_size_t)

# WTX_E* codes used by the package (include/wtx/error.h).
EINVAL, ENOMEM, ESTATE, ENOENT = -1, -2, -3, -4
EIO, ECHECKSUM, EABORTED = -8, -9, -11


def message(rc: int, err: bytes | None = None) -> str:
    text = (err or b"").decode("utf-8", "replace").strip("\0")
    return text or strerror(rc).decode()


def write_err(buf: int, size: int, text: str) -> None:
    """Writes text, NUL-terminated and cut to size, into a C callback's
    err buffer of size bytes (nothing when there is none)."""
    if buf and size:
        data = text.encode()[: size - 1] + b"\0"
        C.memmove(buf, data, len(data))
