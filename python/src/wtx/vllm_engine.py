"""wtx as a vLLM 0.33 weight-transfer backend ("wtx"), both halves.

Worker side, ``WtxWeightTransferEngine`` (``vllm serve ...
--weight-transfer-config '{"backend": "wtx"}'``): the engine hosts wtx's
embedded worker on loopback, loading into ``self.model`` (the draft model
while vLLM targets it) through ``model.load_weights``; vLLM's four calls go
to it, so the session, its checks and the data plane are wtx's own.
``init_info`` / ``update_info`` are the JSON form of ``wtx.v1.InitInfo`` /
``UpdateInfo``, parsed strictly. vLLM's start carries no request, so the
engine's own start waits for the first update: a delta's names its base
(``UpdateInfo.base_version``), which the start is fenced on. An update
that fails before loading starts (a refused chunk, a checksum, an abort)
leaves the weights as they were: tensors are staged and verified, then loaded at
``finish_weight_update``. If ``load_weights`` itself fails part way, the
tensors loaded before the failure stay loaded, as with vLLM's own engines
(which load as they receive); the finish reports the failure. Under
tensor (or pipeline) parallelism every rank receives the whole tensors
(vLLM's routes give all ranks the same messages) and stages only what its
loaders read of them (``serve(narrow_loads=True)``, ``wtx._narrow``).

Trainer side, ``WtxTrainerWeightTransferEngine``: ``trainer_init`` with a
``wtx.WtxTrainerInitInfo`` drives wtx's C trainer engine, with either a
``wtx.WorkerClient`` (gRPC to wtx workers) or any of vLLM's
``VLLMWeightSyncClient``s (``HTTPVLLMWeightSyncClient`` to a vLLM server
running this engine): the C engine hands each call's wtx.v1 message over as
JSON. It is a real subclass of vLLM's ``TrainerWeightTransferEngine``.

Imported by vLLM through the registry (``wtx.vllm_plugin``); needs vLLM.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .client import WorkerClient, WtxError, parse
from .serve import serve
from .trainer import TrainerEngine, WtxTrainerInitInfo
from .v1 import weight_transfer_pb2 as wt


@dataclass
class WtxInitInfo(WeightTransferInitInfo):
    """A parsed ``wtx.v1.InitInfo``."""

    message: Any = None


@dataclass
class WtxUpdateInfo(WeightTransferUpdateInfo):
    """One or more parsed ``wtx.v1.UpdateInfo`` chunks."""

    messages: list[Any] = field(default_factory=list)


class _CurrentModel:
    """The engine's current target model (vLLM switches it to the draft
    model and back), as the embedded worker's module."""

    def __init__(self, engine: "WtxWeightTransferEngine") -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.model, name)


class WtxWeightTransferEngine(WeightTransferEngine[WtxInitInfo, WtxUpdateInfo]):
    init_info_cls = WtxInitInfo
    update_info_cls = WtxUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._server = None
        self._client: WorkerClient | None = None
        # vLLM's start carries no request: the main model's start waits for
        # the first update, whose UpdateInfo may name a delta's base.
        self._pending_start = False

    def parse_init_info(self, init_dict: dict[str, Any]) -> WtxInitInfo:
        return WtxInitInfo(parse(wt.InitInfo, init_dict, "init_info"))

    def parse_update_info(self, update_dict: dict[str, Any] | list[dict[str, Any]]) -> WtxUpdateInfo:
        chunks = update_dict if isinstance(update_dict, list) else [update_dict]
        return WtxUpdateInfo([parse(wt.UpdateInfo, u, "update_info") for u in chunks])

    def _ranks(self) -> int:
        """This engine's model-parallel ranks (tensor x pipeline)."""
        pc = self.parallel_config
        return int(getattr(pc, "tensor_parallel_size", 1) or 1) * \
            int(getattr(pc, "pipeline_parallel_size", 1) or 1)

    def init_transfer_engine(self, init_info: WtxInitInfo) -> None:
        ranks, backend = self._ranks(), init_info.message.WhichOneof("backend")
        if ranks > 1 and backend == "nccl":
            # vLLM's routes give every rank the same InitInfo: one NCCL peer.
            raise ValueError(
                f"init_info: nccl reaches one rank, and this vLLM runs {ranks} "
                "(tensor x pipeline parallel): use tcp, shm (one host) or cuda_ipc "
                "(one node)")
        if self._server is None:
            # WTX_TOKEN_FILE (the deploy/ Secret): the embedded worker asks
            # for it even on loopback, and the engine sends it.
            token_file = os.environ.get("WTX_TOKEN_FILE") or None
            token = open(token_file).readline().strip() if token_file else None
            # A model-parallel rank receives whole tensors (its trainer cannot
            # learn its slices through vLLM's routes; over tcp the ranks
            # relay them along a chain) and stages only what its loaders
            # read of them.
            # WTX_VLLM_KEEP_BASE=1: the host keeps, in host memory, what
            # load_weights was last given (the model's bytes), so a delta's
            # patches apply to it; its trainer must be told
            # (WtxTrainerInitInfo.engines_take_patches).
            keep_base = os.environ.get("WTX_VLLM_KEEP_BASE", "") == "1"
            if keep_base and ranks > 1:
                raise ValueError(f"WTX_VLLM_KEEP_BASE: this vLLM runs {ranks} ranks (tensor x "
                                 "pipeline parallel), each keeping only the slices its "
                                 "loaders read, not the whole tensors a patch applies to")
            self._server = serve(_CurrentModel(self), "127.0.0.1:0", token_file=token_file,
                                 narrow_loads=ranks > 1, keep_base=keep_base)
            self._client = WorkerClient([self._server.address], token=token)
        else:
            # A new init means a new (or restarted) trainer; vLLM's calls have
            # no abort, so an update it left open ends here (weights kept).
            try:
                self._client.abort("a new init_weight_transfer_engine")
            except WtxError:
                pass
        self._pending_start = False
        if ranks > 1 and backend == "tcp":
            self._chain(init_info.message)
        else:
            self._client.init_weight_transfer_engine(init_info.message)

    def _chain(self, message: Any) -> None:
        """tcp under model parallelism: vLLM's routes give every rank the
        trainer's one upstream, so the ranks chain behind it in rank order
        (rank 0 from the trainer, each next from the one before, each
        relaying what it reads), initialized one after another over vLLM's
        world group, each rank's relay address sent to the next. A rank
        whose init fails sends its error instead, and every rank raises."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_world_group
        group = get_world_group()
        me, n, upstream = group.rank_in_group, group.world_size, None
        if n != self._ranks():
            # Every member of the group must join each broadcast below; ranks
            # of other data-parallel engines may not be initializing now.
            raise ValueError(f"init_info: tcp chains this engine's {self._ranks()} ranks over "
                             f"vLLM's world group, which has {n} (data parallel): use shm")
        for r in range(n):
            said = [None]
            if r == me:
                mine = wt.InitInfo()
                mine.CopyFrom(message)
                mine.tcp.relay = r < n - 1
                if upstream is not None:
                    mine.tcp.upstream_address = upstream
                try:
                    resp = self._client.init_weight_transfer_engine(mine)[0]
                    said = [("ok", resp.data_address)]
                except Exception as e:  # noqa: BLE001 (sent on, then raised)
                    said = [("error", f"{type(e).__name__}: {e}")]
            dist.broadcast_object_list(said, src=group.ranks[r], group=group.cpu_group)
            if said[0][0] != "ok":
                raise RuntimeError(f"wtx: rank {r} of {n} could not join the tcp chain: "
                                   f"{said[0][1]}")
            upstream = said[0][1]

    def start_weight_update(self) -> None:
        self._need()
        self._pending_start = True

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        # Synchronous: the chunk is received and verified when this returns
        # (no device work is left behind to synchronize).
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: WtxUpdateInfo) -> None:
        msgs = update_info.messages
        # A delta's first UpdateInfo names its base, and only that.
        self._start_pending(msgs[0].base_version if msgs else "")
        chunks = [m for m in msgs if not m.base_version]
        if chunks:
            self._need().update_weights(chunks)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._start_pending("")  # an update of no chunk
        self._need().finish_weight_update(weight_version)

    def _start_pending(self, base: str) -> None:
        """The start vLLM's call deferred, on base ("": a whole update)."""
        if self._pending_start:
            self._pending_start = False
            self._need().start_weight_update(base_version=base or None)

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def _need(self) -> WorkerClient:
        if self._client is None:
            raise RuntimeError("wtx: init_transfer_engine has not run")
        return self._client


class WtxTrainerWeightTransferEngine(TrainerWeightTransferEngine[WtxTrainerInitInfo]):
    init_info_cls = WtxTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: WtxTrainerInitInfo, *, client: Any,
                     source: Any = None) -> "WtxTrainerWeightTransferEngine":
        info = WtxTrainerInitInfo.from_any(init_info)
        # With many senders every rank sends its own parts, through a client
        # of the workers of its own.
        sender = info.rank == 0 or info.world_size > 1
        self = cls(client=client, source=source, is_sender=sender, rank=info.rank)
        self._inner = TrainerEngine.trainer_init(info, client=client if self.is_sender else None,
                                                 source=source)
        return self

    def send_weights(self, patches: Any = None, *, version: str | None = None) -> dict[str, Any]:
        """vLLM's call; answers wtx's result as TrainerEngine.send_weights
        does (vLLM ignores it). ``patches``: vLLM's sparse_nccl shape (a list
        of SparseWeightPatch), sent as a delta instead of the source."""
        return self._inner.send_weights(patches, version=version)

    def shutdown(self) -> None:
        self._inner.shutdown()
