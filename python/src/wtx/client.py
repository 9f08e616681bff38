"""``WorkerClient``: gRPC to every replica of a model, with vLLM 0.33's
``VLLMWeightSyncClient`` surface (four calls taking plain dicts) plus the
inspection and control calls.

The dicts are the protobuf JSON form of ``wtx.v1.InitInfo`` and
``UpdateInfo``, parsed strictly before any call: an unknown field or a
value of the wrong type is a ``ValueError`` naming it. A call fans out to
every replica; any failure raises ``WtxError`` naming the replica and its
gRPC status (the calls to the other replicas have still run).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format

from .v1 import types_pb2
from .v1 import weight_transfer_pb2 as wt
from .v1 import weight_transfer_pb2_grpc as wt_grpc

DEFAULT_TIMEOUT_S = 300.0


class WtxError(RuntimeError):
    """A call failed on a replica: ``replica`` (index), ``address``, ``code``
    (grpc.StatusCode) and the worker's message."""

    def __init__(self, message: str, *, replica: int | None = None, address: str = "",
                 code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.replica = replica
        self.address = address
        self.code = code


@dataclass(frozen=True)
class Tls:
    """TLS for the gRPC channels: PEM contents (not paths). ``cert``/``key``
    together: mutual TLS."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, ca: str | None = None, cert: str | None = None,
                   key: str | None = None) -> "Tls":
        read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
        return cls(read(ca), read(cert), read(key))


def parse(message_cls: type, data: dict[str, Any] | Any, what: str):
    """``data`` (a dict in protobuf JSON form, or already a message) as
    ``message_cls``, strictly: ValueError names the unknown field or the
    wrong value."""
    if isinstance(data, message_cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{what}: a dict (protobuf JSON of {message_cls.DESCRIPTOR.full_name}) "
                         f"is needed, got {type(data).__name__}")
    msg = message_cls()
    try:
        json_format.ParseDict(data, msg, ignore_unknown_fields=False)
    except json_format.ParseError as e:
        raise ValueError(f"{what}: {e}") from None
    return msg


class WorkerClient:
    """Every replica of one model, each a ``host:port`` of a wtx worker
    (``wtx-worker`` or ``wtx.serve``). ``token``: the bearer token (or None);
    ``tls``: a ``Tls`` (or None: plaintext); ``timeout``: seconds per call."""

    def __init__(self, addresses: str | Sequence[str], *, token: str | None = None,
                 tls: Tls | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("addresses: at least one worker")
        self.token = token
        self.tls = tls
        self.timeout = timeout
        self._channels = []
        for a in self.addresses:
            if tls is not None:
                creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
                self._channels.append(grpc.secure_channel(a, creds))
            else:
                self._channels.append(grpc.insecure_channel(a))
        self._stubs = [wt_grpc.WeightTransferStub(ch) for ch in self._channels]
        self._sessions: list[str] = [""] * len(self.addresses)
        self._updates: list[int] = [0] * len(self.addresses)

    # ---- plumbing ----

    def _metadata(self):
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _each(self, method: str, make) -> list[Any]:
        """Calls method on every replica (make(i) builds its request) at
        once; raises for the first failure, naming the others."""
        futures = [getattr(s, method).future(make(i), timeout=self.timeout,
                                             metadata=self._metadata())
                   for i, s in enumerate(self._stubs)]
        out, failed = [], []
        for i, f in enumerate(futures):
            try:
                out.append(f.result())
            except grpc.RpcError as e:
                out.append(None)
                failed.append((i, e))
        if failed:
            i, e = failed[0]
            others = f" (also failed: worker {', '.join(str(j) for j, _ in failed[1:])})" \
                if len(failed) > 1 else ""
            raise WtxError(f"worker {i} ({self.addresses[i]}): {method}: {e.code().name}: "
                           f"{e.details()}{others}", replica=i, address=self.addresses[i],
                           code=e.code())
        return out

    # ---- vLLM's VLLMWeightSyncClient ----

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> list[Any]:
        """InitWeightTransferEngine on every replica with ``init_info`` (the
        JSON form of wtx.v1.InitInfo, e.g. ``{"shm": {}}``); answers each
        replica's InitWeightTransferEngineResponse (a relaying tcp worker's
        ``data_address``, for instance)."""
        info = parse(wt.InitInfo, init_info, "init_info")
        resps = self._each("InitWeightTransferEngine",
                           lambda i: wt.InitWeightTransferEngineRequest(init_info=info))
        self._sessions = [r.session_id for r in resps]
        return resps

    def start_weight_update(self, target: str = "main", expected_params: int = 0,
                            base_version: str | None = None) -> None:
        """StartWeightUpdate on every replica (``target``: "main" or "draft").
        ``expected_params``: how many tensors the update will send, when
        known (0: not said): each worker sizes its tables for them and
        refuses at once an update over its ``--max-params``.
        ``base_version``: the update is a delta of that version (what it does
        not send carries over); a worker serving another refuses it
        (FAILED_PRECONDITION, a WtxError naming both)."""
        t = {"main": types_pb2.UPDATE_TARGET_MAIN, "draft": types_pb2.UPDATE_TARGET_DRAFT}.get(target)
        if t is None:
            raise ValueError(f"target: 'main' or 'draft', got {target!r}")
        if not 0 <= expected_params < 2**32:
            raise ValueError(f"expected_params: 0..2^32-1, got {expected_params}")
        resps = self._each("StartWeightUpdate", lambda i: wt.StartWeightUpdateRequest(
            session_id=self._sessions[i], target=t, expected_params=expected_params,
            base_version=base_version or ""))
        self._updates = [r.update_id for r in resps]

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """UpdateWeights on every replica for each chunk in ``update_info``
        (the JSON form of wtx.v1.UpdateInfo, or a list of them)."""
        infos = update_info if isinstance(update_info, list) else [update_info]
        parsed = [parse(wt.UpdateInfo, u, f"update_info[{k}]" if len(infos) > 1 else "update_info")
                  for k, u in enumerate(infos)]
        for u in parsed:
            self._each("UpdateWeights", lambda i, u=u: wt.UpdateWeightsRequest(
                session_id=self._sessions[i], update_id=self._updates[i], update_info=u))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """FinishWeightUpdate on every replica: PrepareWeightUpdate on all
        first, so no replica publishes unless every one can."""
        v = weight_version or ""
        self._each("PrepareWeightUpdate", lambda i: wt.PrepareWeightUpdateRequest(
            session_id=self._sessions[i], update_id=self._updates[i], weight_version=v))
        self._each("FinishWeightUpdate", lambda i: wt.FinishWeightUpdateRequest(
            session_id=self._sessions[i], update_id=self._updates[i], weight_version=v))

    # ---- inspection and control ----

    def abort(self, reason: str = "aborted by the trainer") -> None:
        """AbortWeightUpdate of the active update on every replica (the
        previous weights stay)."""
        self._each("AbortWeightUpdate", lambda i: wt.AbortWeightUpdateRequest(
            session_id=self._sessions[i], reason=reason))

    def get_weight_info(self, include_params: bool = False) -> list[dict[str, Any]]:
        """GetWeightInfo of every replica, as dicts (protobuf JSON form)."""
        resps = self._each("GetWeightInfo", lambda i: wt.GetWeightInfoRequest(
            include_params=include_params))
        return [json_format.MessageToDict(r, preserving_proto_field_name=True) for r in resps]

    def get_world_size(self) -> int:
        """Receiving ranks over every replica."""
        return sum(r.world_size for r in self._each("GetWorldSize",
                                                     lambda i: wt.GetWorldSizeRequest()))

    def pause(self, wait_for_inflight: bool = True) -> list[bool]:
        """Pauses generation on every replica; returns whether each is
        paused now (a sidecar: what vLLM answered)."""
        resps = self._each("Pause", lambda i: wt.PauseRequest(wait_for_inflight=wait_for_inflight))
        return [r.paused for r in resps]

    def resume(self) -> list[bool]:
        """Resumes generation; returns whether each replica is still paused."""
        return [r.paused for r in self._each("Resume", lambda i: wt.ResumeRequest())]

    def update_weight_version(self, weight_version: str) -> list[str]:
        """Relabels every replica's weights; returns each previous label."""
        resps = self._each("UpdateWeightVersion", lambda i: wt.UpdateWeightVersionRequest(
            weight_version=weight_version))
        return [r.previous_version for r in resps]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
