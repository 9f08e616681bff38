"""``TrainerEngine``: vLLM 0.33's trainer-side contract over wtx's C engine.

``TrainerEngine.trainer_init(init_info, client=..., source=...)`` on every
trainer rank, then ``send_weights()`` every RL step, then ``shutdown()``.
Rank 0 sends; the other ranks only iterate their source (keeping any
collectives of an FSDP gather aligned). The whole push runs in C: the
source hands each tensor's host memory to the engine once (a contiguous
CPU tensor in place), and chunking, checksums, the data plane and the
control plane never touch Python.
"""
from __future__ import annotations

import ctypes as C
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from google.protobuf import json_format

from . import _capi
from .client import Tls, WorkerClient, WtxError
from .sources import CSource, SafetensorsSource
from .v1 import weight_transfer_pb2 as wt

_CHECKSUMS = {None: 0, "default": 0, "none": 1, "xxh3_64": 2}
TRANSPORTS = ("shm", "tcp", "cuda_ipc", "nccl")


@dataclass
class WtxTrainerInitInfo:
    """The trainer's side of the rendezvous (shaped like vLLM's
    ``TrainerInitInfo``: ``rank`` keyword-only, ``backend`` a ClassVar).

    transport: "shm" (same host), "tcp", "cuda_ipc" (same node, GPU) or
    "nccl". packed: tensors share chunks (False: one tensor per chunk).
    checksum: None (the transport's default: XXH3-64 on shm and tcp, none on
    GPU), "none" or "xxh3_64". buffer_size / num_buffers: 0 for the
    defaults. timeout_ms: bound on every step (0: the default).
    data_address: tcp, where the trainer's data port listens. direct:
    cuda_ipc and nccl, every update lands straight in a region the model's
    size that each worker holds on its GPU (one copy per byte for a worker
    whose model adopts it; buffers where a worker has no room); on
    cuda_ipc ``send_weights()["direct"]`` says whether it took effect.
    delta: each sync sends only the tensors whose XXH3-64 differs from what
    every worker serves (one hash pass over the source; on cuda_ipc and
    nccl with checksum "xxh3_64"); ``send_weights()["delta"]`` says whether
    it was a delta, ``["full_reason"]`` why the whole model went instead.
    True or "tensors"; "patches": a changed tensor goes as a patch of the
    elements that changed where that is fewer bytes (the engine keeps a
    host copy of the model for it). engines_take_patches: with a client of
    vLLM's (its HTTP or Ray client), whose start answers nothing, the
    caller's word that every engine behind it takes patches (vLLM started
    with the wtx plugin and WTX_VLLM_KEEP_BASE=1); without it a delta
    sends changed tensors whole there, and the caller's own patches are
    refused. wtx workers say it themselves: not with a WorkerClient."""

    backend: ClassVar[str] = "wtx"

    transport: str = "shm"
    packed: bool = True
    checksum: str | None = None
    buffer_size: int = 0
    num_buffers: int = 0
    timeout_ms: int = 0
    data_address: str | None = None
    direct: bool = False
    delta: bool | str = field(default=False, kw_only=True)
    rank: int = field(default=0, kw_only=True)
    # Many senders (any transport): world_size ranks, each sending the parts
    # it owns (the source's iter_local) straight to the workers;
    # rank_addresses[r] is rank r's data port (over nccl, where rank 0
    # reaches it to check its plan and name each sync's communicator), the
    # same list on every rank, and session_token (16..64 bytes) a secret
    # they share.
    world_size: int = field(default=1, kw_only=True)
    rank_addresses: list[str] | None = field(default=None, kw_only=True)
    session_token: str | None = field(default=None, kw_only=True)
    engines_take_patches: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.checksum not in _CHECKSUMS:
            raise ValueError(f"checksum: None, 'none' or 'xxh3_64', got {self.checksum!r}")
        if self.rank < 0:
            raise ValueError(f"rank: must be >= 0, got {self.rank}")
        if self.delta not in _DELTAS:
            raise ValueError(f"delta: False, True, 'tensors' or 'patches', got {self.delta!r}")
        if self.world_size > 1 and (self.rank >= self.world_size
                                    or len(self.rank_addresses or ()) != self.world_size
                                    or not self.session_token):
            raise ValueError(f"world_size {self.world_size}: needs a rank below it, "
                             "rank_addresses with one entry per rank and a session_token")

    @classmethod
    def from_any(cls, info: "WtxTrainerInitInfo | dict[str, Any]") -> "WtxTrainerInitInfo":
        if isinstance(info, cls):
            return info
        if isinstance(info, dict):
            known = set(cls.__dataclass_fields__)
            unknown = sorted(set(info) - known)
            if unknown:
                raise ValueError(f"init_info: unknown field {unknown[0]!r} (known: "
                                 f"{', '.join(sorted(known))})")
            return cls(**info)
        raise TypeError(f"init_info: a WtxTrainerInitInfo or a dict, got {type(info).__name__}")


# WtxTrainerInitInfo.delta -> wtx_trainer_config.delta (wtx_delta).
_DELTAS = {False: 0, None: 0, True: 1, "tensors": 1, "patches": 2}


def _c_patches(patches: list[Any]) -> tuple[Any, list[Any]]:
    """vLLM's SparseWeightPatch list (or dicts of name, indices, values,
    full_shape) as a ctypes array of wtx_patch, indices sorted ascending
    (values with them) and 64-bit past 2^31 elements, all on the host; and
    the arrays it points into, to keep alive."""
    import numpy as np
    from . import _dtypes
    out = (_capi.Patch * len(patches))()
    keep: list[Any] = []
    for k, p in enumerate(patches):
        get = p.get if isinstance(p, dict) else lambda a, p=p: getattr(p, a)
        name, shape = get("name"), tuple(int(d) for d in get("full_shape"))
        idx, val = get("indices"), get("values")
        if hasattr(idx, "detach"):
            idx = idx.detach().cpu().numpy()
        wire = _dtypes.to_wire(val.dtype)
        if hasattr(val, "detach"):  # torch: bf16/fp8 as their bytes
            val = val.detach().cpu().contiguous().view(-1)
            val = val.view(_dtypes.to_torch({1: 6, 2: 8, 4: 9, 8: 10}[val.element_size()]))
            val = val.numpy()
        idx, val = np.asarray(idx).reshape(-1), np.asarray(val).reshape(-1)
        if idx.shape != val.shape:
            raise ValueError(f"patches[{k}] ({name!r}): {idx.size} indices, {val.size} values")
        elements = int(np.prod(shape)) if shape else 1
        itype = np.int64 if elements > 2**31 else np.int32
        order = np.argsort(idx, kind="stable")
        idx = np.ascontiguousarray(idx[order], dtype=itype)
        val = np.ascontiguousarray(val[order])
        dims = (C.c_uint64 * max(len(shape), 1))(*shape)
        keep += [idx, val, dims, name.encode()]
        out[k] = _capi.Patch(name=keep[-1], dtype=wire, shape=dims, ndim=len(shape),
                             index_dtype=10 if itype is np.int64 else 9, count=idx.size,
                             indices=idx.ctypes.data, values=val.ctypes.data)
    return out, keep


def _check_ownership(source: Any, rank: int) -> None:
    """For now every parameter is sent by rank 0: refuse one it does not own."""
    for m in source.metadata:
        owners = getattr(m, "owners", None)
        if owners is not None and 0 not in owners:
            raise ValueError(f"parameter {m.name!r} is not owned by the sending rank 0 (owners "
                             f"{tuple(owners)}); sharded ownership is not supported yet")


class TrainerEngine:
    """A trainer rank's wtx engine. Build it with ``trainer_init``."""

    init_info_cls = WtxTrainerInitInfo

    def __init__(self) -> None:
        self._trainer = C.c_void_p()
        self._client = C.c_void_p()
        self._source: Any = None
        self._csource: CSource | None = None
        self._progress_cb: Any = None
        self.rank = 0
        self.is_sender = True
        self._control: _ControlPlane | None = None
        self.last_result: dict[str, Any] | None = None

    @classmethod
    def trainer_init(cls, init_info: WtxTrainerInitInfo | dict[str, Any], *,
                     client: WorkerClient | None, source: Any = None) -> "TrainerEngine":
        """Rendezvous with every replica of ``client`` (rank 0) and return
        the engine. ``source``: a WeightSource (``metadata`` +
        ``iter_full``). Raises ValueError for bad arguments, WtxError when a
        replica refuses."""
        info = WtxTrainerInitInfo.from_any(init_info)
        if source is None:  # only patches can be sent (vLLM's sparse_nccl shape)
            from .sources import DictSource
            source = DictSource({})
        many = info.world_size > 1
        if not many:
            _check_ownership(source, info.rank)
        self = cls()
        self.rank = info.rank
        self.is_sender = info.rank == 0 or many
        self._source = source
        if self.is_sender:
            if isinstance(client, WorkerClient):
                if info.engines_take_patches:
                    raise ValueError("engines_take_patches: for a client of vLLM's, whose start "
                                     "answers nothing; wtx workers say whether they take "
                                     "patches themselves")
                self._client = _c_client(client)
            elif all(callable(getattr(client, m, None)) for m in _CONTROL_CALLS):
                self._control = _ControlPlane(client, info.engines_take_patches)
                self._client = self._control.c
            else:
                raise TypeError("client: a wtx.WorkerClient, or an object with vLLM's four "
                                f"weight-sync calls ({', '.join(_CONTROL_CALLS)}); got "
                                f"{type(client).__name__}")
        c_src = source._c if isinstance(source, SafetensorsSource) else None
        if c_src is None:
            self._csource = CSource(source, info.rank, info.world_size)
            c_src = self._csource.c
        cfg = _capi.TrainerConfig(rank=info.rank, backend=info.transport.encode(),
                                  unpacked=0 if info.packed else 1,
                                  buffer_size=info.buffer_size, num_buffers=info.num_buffers,
                                  checksum=_CHECKSUMS[info.checksum], timeout_ms=info.timeout_ms,
                                  data_address=info.data_address.encode() if info.data_address else None,
                                  direct=1 if info.direct else 0, world=info.world_size,
                                  delta=_DELTAS[info.delta])
        if many:
            self._ranks = (C.c_char_p * info.world_size)(*[a.encode() for a in info.rank_addresses])
            cfg.rank_addresses = C.cast(self._ranks, C.POINTER(C.c_char_p))
            cfg.session_token = info.session_token.encode()
        err = C.create_string_buffer(_capi.ERRBUF)
        rc = _capi.trainer_init(C.byref(cfg), self._client, c_src, C.byref(self._trainer), err,
                                _capi.ERRBUF)
        if rc != 0:
            self.shutdown()
            raise _error(rc, err.value)
        return self

    def send_weights(self, patches: list[Any] | None = None, *, version: str | None = None,
                     target: str = "main",
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """One weight sync: every replica publishes the source's current
        weights, or none does (their previous weights stay). Returns
        {bytes, params, chunks, seconds, version, xxh3, direct, control_bytes,
        delta, skipped_params, skipped_bytes, full_reason}: bytes and params
        are what the sync sent (a delta's changed tensors), xxh3 every
        tensor's checksum (a Checksums sequence; None when the sync made
        none). ``progress`` is called (done_bytes, total_bytes)
        after every chunk.

        ``patches`` (vLLM's sparse_nccl shape: SparseWeightPatch, or dicts
        of name, indices, values, full_shape): instead of the source, these
        element patches, applied by every worker to a copy of the version
        it serves (the one this engine saw last); indices in any order,
        none twice. An empty list sends nothing."""
        if not self._trainer:
            raise RuntimeError("send_weights after shutdown")
        if patches is not None:
            return self._send_patches(list(patches), version, target)
        t = {"main": 1, "draft": 2}.get(target)
        if t is None:
            raise ValueError(f"target: 'main' or 'draft', got {target!r}")
        cb = _capi.PROGRESS(lambda _a, done, total: progress(done, total)) if progress else \
            _capi.PROGRESS()
        opts = _capi.SendOptions(version=version.encode() if version else None, target=t,
                                 progress=cb, progress_arg=None)
        res = _capi.SendResult()
        rc = _capi.trainer_send(self._trainer, C.byref(opts), C.byref(res))
        if rc != 0:
            cause = self._csource.error if self._csource is not None else None
            msg = _capi.trainer_last_error(self._trainer) or b""
            if cause is not None:
                self._csource.error = None
                raise _error(rc, msg) from cause
            raise _error(rc, msg)
        return self._result(res)

    def _send_patches(self, patches: list[Any], version: str | None,
                      target: str) -> dict[str, Any]:
        t = {"main": 1, "draft": 2}.get(target)
        if t is None:
            raise ValueError(f"target: 'main' or 'draft', got {target!r}")
        arr, _keep = _c_patches(patches)
        opts = _capi.SendOptions(version=version.encode() if version else None, target=t,
                                 progress=_capi.PROGRESS(), progress_arg=None)
        res = _capi.SendResult()
        rc = _capi.trainer_send_patches(self._trainer, arr, len(patches), C.byref(opts),
                                        C.byref(res))
        if rc != 0:
            raise _error(rc, _capi.trainer_last_error(self._trainer) or b"")
        return self._result(res)

    def _result(self, res: Any) -> dict[str, Any]:
        n = res.params + res.skipped_params
        self.last_result = {
            "bytes": res.bytes, "params": res.params, "chunks": res.chunks,
            "seconds": res.seconds, "version": res.version.decode(),
            "xxh3": Checksums(C.addressof(res.xxh3.contents), n) if res.xxh3 else None,
            "direct": bool(res.direct), "control_bytes": res.control_bytes,
            "delta": bool(res.delta), "skipped_params": res.skipped_params,
            "skipped_bytes": res.skipped_bytes,
            "full_reason": res.full_reason.decode() if res.full_reason else None,
            "patched_params": res.patched_params,
            "patched_whole_bytes": res.patched_whole_bytes}
        return self.last_result

    def shutdown(self) -> None:
        """Releases the data plane and the C objects (the workers keep their
        weights). Idempotent."""
        if self._trainer:
            _capi.trainer_shutdown(self._trainer)
            self._trainer = C.c_void_p()
        if self._client:
            _capi.client_destroy(self._client)
            self._client = C.c_void_p()
        self._control = None
        if self._csource is not None:
            self._csource.close()
            self._csource = None

    def __del__(self) -> None:
        self.shutdown()


_CONTROL_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                  "finish_weight_update")


class Checksums(Sequence):
    """Every tensor's XXH3-64 from one sync, in the source's order: a
    read-only sequence of ints over a copy of the engine's array. An int is
    made only when one is read (making 40k of them at every sync would cost
    most of a millisecond); ``list(sums)`` gives a list."""

    __slots__ = ("_v",)

    def __init__(self, address: int, n: int) -> None:
        self._v = memoryview(C.string_at(address, n * 8)).cast("Q")

    def __len__(self) -> int:
        return len(self._v)

    def __getitem__(self, i: Any) -> Any:
        return self._v[i].tolist() if isinstance(i, slice) else self._v[i]

    def __iter__(self) -> Any:
        return iter(self._v)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Checksums, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Checksums({self._v.tolist()!r})"


class _ControlPlane:
    """Any VLLMWeightSyncClient (vLLM's HTTP or Ray client, or one of the
    caller's) as the C engine's control plane: the engine hands over
    serialized wtx.v1 messages, which go to the client as their JSON form."""

    def __init__(self, client: Any, patches: bool = False) -> None:
        self.client = client
        self.ops = _capi.ControlOps(_capi.CONTROL_OPS_VERSION,
                                    _capi.C_INIT(self._init), _capi.C_START(self._start),
                                    _capi.C_UPDATE(self._update), _capi.C_FINISH(self._finish),
                                    _capi.C_ABORT(self._abort), 1 if patches else 0)
        self.c = C.c_void_p()
        rc = _capi.client_create_control(C.byref(self.ops), None, C.byref(self.c))
        if rc != 0:
            raise _error(rc, None)

    @staticmethod
    def _run(err: int, errlen: int, call: Callable[[], Any]) -> int:
        try:
            call()
            return 0
        except BaseException as e:  # noqa: BLE001 (reported through the engine)
            _capi.write_err(err, errlen, f"{type(e).__name__}: {e}")
            return _capi.EIO

    @staticmethod
    def _json(cls: type, data: int, n: int) -> dict[str, Any]:
        return json_format.MessageToDict(cls.FromString(C.string_at(data, n)))

    def _init(self, _s, data, n, err, errlen) -> int:
        return self._run(err, errlen, lambda: self.client.init_weight_transfer_engine(
            self._json(wt.InitInfo, data, n)))

    def _start(self, _s, target, err, errlen) -> int:
        if target == 2:
            draft = getattr(self.client, "start_draft_weight_update", None)
            if draft is None:
                _capi.write_err(err, errlen, "this client cannot start a draft update")
                return _capi.EINVAL
            return self._run(err, errlen, draft)
        return self._run(err, errlen, self.client.start_weight_update)

    def _update(self, _s, data, n, err, errlen) -> int:
        return self._run(err, errlen, lambda: self.client.update_weights(
            self._json(wt.UpdateInfo, data, n)))

    def _finish(self, _s, version, err, errlen) -> int:
        v = version.decode() if version else None
        return self._run(err, errlen, lambda: self.client.finish_weight_update(v or None))

    def _abort(self, _s, reason) -> None:
        abort = getattr(self.client, "abort", None)  # vLLM's clients have none
        if callable(abort):
            try:
                abort(reason.decode() if reason else "")
            except BaseException:  # noqa: BLE001
                pass


def _error(rc: int, msg: bytes | None) -> Exception:
    text = _capi.message(rc, msg)
    if rc == _capi.EINVAL:
        return ValueError(text)
    return WtxError(text)


def _c_client(client: WorkerClient) -> C.c_void_p:
    """A C wtx_client to the same replicas, with the same credentials."""
    addrs = (C.c_char_p * len(client.addresses))(*[a.encode() for a in client.addresses])
    tls: Tls | None = client.tls
    opts = _capi.ClientOptions(timeout_ms=int(client.timeout * 1000), retries=2,
                               token=client.token.encode() if client.token else None,
                               tls_ca_pem=tls.ca if tls else None,
                               tls_cert_pem=tls.cert if tls else None,
                               tls_key_pem=tls.key if tls else None)
    out = C.c_void_p()
    err = C.create_string_buffer(_capi.ERRBUF)
    rc = _capi.client_create(addrs, len(client.addresses), C.byref(opts), C.byref(out), err,
                             _capi.ERRBUF)
    if rc != 0:
        raise _error(rc, err.value)
    return out
