"""``wtx.serve``: the gRPC worker inside a Python inference process.

The C worker (wtx_worker_start) receives every update over the data plane
into staging tensors this module allocates; nothing of the module moves
until the update is complete and verified (checksums, every tensor
loaded). A module on a GPU gets its staging tensors on that GPU when the
trainer uses a GPU backend (cuda_ipc, nccl): the bytes go device to device
and never through host memory. Then, at commit, the staged tensors are
loaded into the module: through ``module.load_weights(iterable)`` when it
has one (as vLLM models do), else copied into its parameters and buffers
by name. A failed or aborted update leaves the module's weights unchanged,
except what a ``load_weights`` that raises partway loaded before raising
(the trainer gets INTERNAL, this module's log the exception, and
``version`` stays the last one loaded whole).
The small tensors of a chunk are views of one buffer, each made as
``load_weights`` reads it: one that keeps a staged tensor instead of
copying it keeps that buffer.
"""
from __future__ import annotations

import ctypes as C
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from . import _capi, _dtypes
from .client import WtxError

log = logging.getLogger("wtx.serve")

_REFLECTION = {"open": 0, "token": 1, "off": 2}


# Host staging: tensors of at most _SMALL bytes share a chunk's buffer, each
# at an _ALIGN-byte boundary.
_SMALL = 64 << 10
_ALIGN = 16
# A wtx_tensor_meta in 8-byte words: the chunk's metas are read as rows.
_META_WORDS = C.sizeof(_capi.TensorMeta) // 8


def _meta_names(addr: int, n: int) -> list[str]:
    """The names of the n wtx_tensor_meta at addr: one strided slice of
    their name pointers, not a ctypes struct made per tensor."""
    ptrs = (C.c_char_p * (n * _META_WORDS)).from_address(addr)
    return [b.decode() for b in ptrs[_capi.TensorMeta.name.offset // 8::_META_WORDS]]


class _MetaTable:
    """A chunk's n wtx_tensor_meta (C memory, valid during the call) read
    as one int64 tensor of n rows: dtype, ndim, nbytes, and kind (dtype,
    ndim, then the shape's dims, zero past ndim) as columns, no Python
    object per tensor (_meta_names reads their names)."""

    def __init__(self, torch: Any, metas: Any, n: int) -> None:
        T = _capi.TensorMeta
        addr = C.cast(metas, C.c_void_p).value
        raw = (C.c_int64 * (n * _META_WORDS)).from_address(addr)
        rows = torch.frombuffer(raw, dtype=torch.int64).view(n, _META_WORDS).clone()
        shape_at = T.shape.offset // 8
        self.ndim = rows[:, T.ndim.offset // 8]
        self.nbytes = rows[:, T.nbytes.offset // 8]
        dtype = rows[:, T.dtype.offset // 8] & 0xFFFFFFFF  # an int: the word's low half
        dims = rows[:, shape_at:shape_at + _capi.MAX_DIMS]
        dims = dims * (torch.arange(_capi.MAX_DIMS) < self.ndim[:, None])  # past ndim: unset
        self.kind = torch.cat([dtype[:, None], self.ndim[:, None], dims], 1)
        self._torch = torch

    def kinds(self, at: Any) -> tuple[Any, Any]:
        """The distinct kinds of the rows at (a tensor of indices), and each
        row's index among them: torch.unique over one hash per row (the
        kinds compared whole after, and by rows when two kinds share a
        hash), as unique over whole rows sorts the rows themselves."""
        torch = self._torch
        rows = self.kind[at]
        h = torch.zeros(len(rows), dtype=torch.int64)
        for col in rows.unbind(1):  # wraps around: a hash
            h = h * 1000003 + col
        _, kind_of = torch.unique(h, return_inverse=True)
        some = torch.zeros(int(kind_of.max()) + 1, dtype=torch.int64)
        some[kind_of] = torch.arange(len(rows))  # a row of each kind, whichever
        kinds = rows[some]
        if not bool((kinds[kind_of] == rows).all()):
            kinds, kind_of = torch.unique(rows, dim=0, return_inverse=True)
        return kinds, kind_of


class _Chunk:
    """The tensors one chunk staged, in update order: their names and, for
    each, either its place in the chunk's buffer (its kind's typed view of
    the buffer, and an element offset) or, kind -1, a tensor of its own (a
    large one; offset: its index in own). items() makes a small tensor's
    view only when it is asked for."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.first = 0  # its first tensor's index among the update's staged
        self.adopted = False  # viewed in the worker's receive region (_adopt_chunk)
        self.kind: list[int] = []  # per tensor: its kind's index, -1: its own
        self.offset: list[int] = []  # per tensor: elements into typed[kind], or into own
        self.own: list[Any] = []
        self.typed: list[Any] = []  # per kind: the buffer viewed as its dtype
        self.shape: list[tuple[int, ...]] = []
        self.stride: list[tuple[int, ...]] = []

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, tensor) in order. A run of tensors of one kind at a
        constant step in the buffer (up to _RUN of them) is made in two
        calls, one view of the run and its unbind, instead of an as_strided
        each (a Python call per tensor); the run's views live while it is
        read."""
        view = [t.as_strided for t in self.typed]
        names, kind, offset = self.names, self.kind, self.offset
        shape, stride, own = self.shape, self.stride, self.own
        i, n = 0, len(names)
        while i < n:
            k = kind[i]
            if k < 0:
                if own[offset[i]] is not None:  # None: load_weights reads none of it
                    yield names[i], own[offset[i]]
                i += 1
                continue
            j = _run_end(kind, offset, i, min(n, i + _RUN))
            if j - i == 1:
                yield names[i], view[k](shape[k], stride[k], offset[i])
            else:
                step = offset[i + 1] - offset[i]
                run = view[k]((j - i, *shape[k]), (step, *stride[k]), offset[i])
                yield from zip(names[i:j], run.unbind(0))
            i = j


# Tensors made per call in _Chunk.items: a run's views live until it is read.
_RUN = 1024


def _run_end(kind: list[int], offset: list[int], i: int, most: int) -> int:
    """The end of the run from i (before most): the tensors after i of
    i's kind, each the same step in elements after the one before it."""
    k, j = kind[i], i + 1
    if j == most or kind[j] != k or offset[j] <= offset[i]:
        return j
    step = offset[j] - offset[i]
    j += 1
    while j < most and kind[j] == k and offset[j] - offset[j - 1] == step:
        j += 1
    return j


class _Staged:
    """An update's staged tensors, in order. A small tensor's view is made
    when the model loads it, not at staging: made at staging, the views of
    an MoE model's 40k tensors lived until commit, and Python's garbage
    collector walked them again and again (a third of a sync into a
    host)."""

    def __init__(self) -> None:
        self.n = 0  # tensors staged
        self._parts: list[Any] = []
        self.held = 0  # bytes staged now
        self.peak = 0  # the most held in this update
        # (index staged, chunk, place in its own, what load_weights reads)
        # of each tensor to cut down to what the loader reads once complete.
        self.to_narrow: list[tuple[int, _Chunk, int, Any]] = []

    def add_chunk(self, chunk: _Chunk) -> None:
        chunk.first = self.n
        self._parts.append(chunk)
        self.n += len(chunk.names)

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def narrow(self, complete: int) -> None:
        """The tensors to narrow of the first `complete` staged, cut to
        what the loader reads (their whole staging freed)."""
        if not self.to_narrow:  # a host without narrow_loads, each chunk
            return
        from . import _narrow
        done = 0
        for i, chunk, j, rule in self.to_narrow:
            if i >= complete:
                break
            whole = chunk.own[j]
            chunk.own[j] = None if rule == _narrow.NOTHING else \
                _narrow.keep(chunk.names[i - chunk.first], whole, rule)
            if not chunk.adopted:  # an adopted one is the worker's memory
                self.held -= whole.nbytes
            if chunk.own[j] is not None:
                self.hold(chunk.own[j].part.nbytes)
            done += 1
        del self.to_narrow[:done]

    def name_at(self, i: int) -> str:
        """The name of the i-th tensor staged (i < n)."""
        for part in self._parts:
            if i < len(part.names):
                return part.names[i]
            i -= len(part.names)
        raise IndexError(i)

    def add(self, name: str, tensor: Any) -> _Chunk:
        chunk = _Chunk([name])
        chunk.kind, chunk.offset, chunk.own = [-1], [0], [tensor]
        self.add_chunk(chunk)
        self.hold(tensor.nbytes)
        return chunk

    def items(self) -> Iterator[tuple[str, Any]]:
        for part in self._parts:
            yield from part.items()

    def kept(self) -> list[tuple[str, Any]]:
        """items() to keep past the update (keep_base): a large tensor as
        staged (its own buffer), a small one copied out of its chunk's
        buffer, which would otherwise live as long as any of its tensors
        is kept."""
        out = []
        for part in self._parts:
            # an adopted chunk's tensors are the worker's until commit
            own = set() if part.adopted else {id(t) for t in part.own}
            out.extend((n, t if id(t) in own else t.clone()) for n, t in part.items())
        return out

    def clear(self) -> None:
        self.n = 0
        self._parts.clear()
        self.to_narrow.clear()
        self.held = 0


class _Host:
    """The model ops behind the C worker, for one torch module."""

    def __init__(self, module: Any, on_pause: Callable[[bool], None] | None,
                 on_resume: Callable[[], None] | None, device_staging: bool,
                 narrow_loads: bool = False, keep_base: bool = False) -> None:
        import torch
        self.torch = torch
        self.module = module
        # What load_weights reads of each tensor (wtx._narrow), per model
        # (vLLM switches to its draft model and back), learned once a name.
        self.narrow_loads = narrow_loads
        # keep_base: the checkpoint tensors load_weights was last given, by
        # name, in host memory: what a delta's patch applies to, as a module
        # whose load_weights maps names cannot be read back by them.
        self.base: dict[str, Any] | None = {} if keep_base else None
        self.reads: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.lock = threading.Lock()  # C calls one at a time; commit vs readers of .version
        self.version = ""
        self.staged = _Staged()
        # Tensors of this update loaded whole: the C worker loads them in
        # the order it staged them (each chunk's, then the next's), so a
        # count says which are, without a name per tensor.
        self.loaded = 0
        # The module's parameters and buffers by name, listed once per
        # update (at its first check) instead of once per tensor checked,
        # which made an update quadratic in the number of parameters.
        self.update_targets: dict[str, Any] | None = None
        self.torch_dtypes: dict[int, Any] = {}
        # Each wire dtype's element size, indexed by the dtype (1 for the
        # numbers none has: the session checked every dtype).
        self.esizes = torch.tensor([_dtypes.element_size(w) if w in _dtypes.WIRE else 1
                                    for w in range(max(_dtypes.WIRE) + 1)], dtype=torch.int64)
        reads = self._loader() is None or self.base is not None  # see _read
        self.ops = _capi.ModelOps(
            _capi.MODEL_OPS_VERSION, _capi.M_CHECK(self._check), _capi.M_BEGIN(self._begin), _capi.M_STAGE(self._stage),
            _capi.M_LOADED(self._loaded), _capi.M_PREPARE(self._prepare),
            _capi.M_COMMIT(self._commit), _capi.M_ABORT(self._abort),
            _capi.M_STAGE_DEVICE(self._stage_device) if device_staging
            else _capi.M_STAGE_DEVICE(),
            _capi.M_ADOPT_DEVICE(),  # staged (a device copy) even in a direct session
            _capi.M_CHECK_CHUNK(self._check_chunk), _capi.M_STAGE_CHUNK(self._stage_chunk),
            _capi.M_LOADED_CHUNK(self._loaded_chunk), _capi.M_CHECK_RANGE(), _capi.M_REVERT(),
            # A delta's patches need the served tensor by its checkpoint name:
            # the module's own names, unless a load_weights maps them (vLLM's
            # fused and sharded parameters), which cannot be read back; then
            # only what keep_base kept.
            _capi.M_READ() if not reads else _capi.M_READ(self._read),
            # Read in place in the worker's receive region where there is one
            # (shm with many senders), unless this host takes patches: a
            # session with a region takes none (they apply to staging).
            _capi.M_ADOPT_CHUNK() if reads else _capi.M_ADOPT_CHUNK(self._adopt_chunk))
        self.pause_cb = _capi.ON_PAUSE(self._pause)
        self.resume_cb = _capi.ON_RESUME(self._resume)

    def _loader(self) -> Callable[[Any], Any] | None:
        """The module's load_weights, looked up at each use (a host may
        switch the module it stands for, as vLLM does for a draft model)."""
        return getattr(self.module, "load_weights", None)

    def _targets(self) -> dict[str, Any]:
        d = dict(self.module.named_parameters())
        d.update(dict(self.module.named_buffers()))
        return d

    def _update_targets(self) -> dict[str, Any]:
        """_targets() as of this update's first use; begin, commit and abort
        forget it, so each update sees the module as it then is."""
        if self.update_targets is None:
            self.update_targets = self._targets()
        return self.update_targets

    def _refusal(self, m: Any) -> tuple[int, str]:
        """(0, "") when the module's own parameters take the tensor m
        describes, else the error and why."""
        name = m.name.decode()
        t = self._update_targets().get(name)
        if t is None:
            return _capi.ENOENT, f"parameter '{name}' is not in the module"
        shape = tuple(m.shape[:m.ndim])
        if tuple(t.shape) != shape or _dtypes.to_wire(t.dtype) != m.dtype:
            return _capi.EINVAL, (f"parameter '{name}': {_dtypes.WIRE[m.dtype][0]} "
                                  f"{list(shape)}, the module holds {t.dtype} {list(t.shape)}")
        return 0, ""

    def _check(self, _m, target, meta, err, errlen) -> int:
        return self._check_chunk(_m, target, meta, 1, None, err, errlen)

    # The C worker calls the *_chunk ops once per chunk (one UpdateWeights)
    # in place of the per-tensor ones, three per tensor, each a call from
    # its threads into Python.
    def _check_chunk(self, _m, target, metas, n, bad, err, errlen) -> int:
        try:
            if target != 1:
                _capi.write_err(err, errlen, "this host has no draft model")
                return _capi.ESTATE
            if self._loader() is not None:
                return 0  # load_weights maps checkpoint names itself
            for i in range(n):
                rc, why = self._refusal(metas[i])
                if rc != 0:
                    if bad:
                        bad[0] = i
                    _capi.write_err(err, errlen, why)
                    return rc
            return 0
        except BaseException as e:  # noqa: BLE001 (a callback must not raise into C)
            _capi.write_err(err, errlen, f"check failed: {e}")
            return _capi.EIO

    def _read(self, _m, target, meta, dst, err, errlen) -> int:
        """The served bytes of meta's tensor into dst (host memory of
        meta.nbytes), for the C worker to apply a patch to."""
        try:
            with self.lock:
                if self.base is not None and self._loader() is not None:
                    rc, why = self._read_base(meta.contents, target, dst)
                    if rc != 0:
                        _capi.write_err(err, errlen, why)
                    return rc
                rc, why = self._refusal(meta.contents)
                if rc != 0 or target != 1:
                    _capi.write_err(err, errlen, why or "this host has no draft model")
                    return rc or _capi.ESTATE
                # The update's listing, which _refusal just used: one walk
                # of the module per update, not one per patch.
                t = self._update_targets()[meta.contents.name.decode()]
                src = t.detach().contiguous().cpu()
                C.memmove(dst, src.data_ptr(), meta.contents.nbytes)
            return 0
        except BaseException as e:  # noqa: BLE001 (a callback must not raise into C)
            _capi.write_err(err, errlen, f"read failed: {e}")
            return _capi.EIO

    def _read_base(self, m: Any, target: int, dst: Any) -> tuple[int, str]:
        """_read from what load_weights was last given (keep_base)."""
        name = m.name.decode()
        t = self.base.get(name) if target == 1 else None
        if t is None:
            return _capi.ENOENT, (f"'{name}': this host has loaded no such tensor"
                                  if target == 1 else "this host has no draft model")
        shape = tuple(m.shape[:m.ndim])
        if tuple(t.shape) != shape or _dtypes.to_wire(t.dtype) != m.dtype:
            return _capi.EINVAL, (f"'{name}': {_dtypes.WIRE[m.dtype][0]} {list(shape)}, "
                                  f"this host last loaded {t.dtype} {list(t.shape)}")
        C.memmove(dst, t.data_ptr(), m.nbytes)
        return 0, ""

    def _begin(self, _m, target) -> int:
        self.staged.clear()
        self.staged.peak = 0
        self.loaded = 0
        self.update_targets = None
        return 0

    def _torch_dtype(self, wire: int) -> Any:
        dtype = self.torch_dtypes.get(wire)
        if dtype is None:
            dtype = self.torch_dtypes[wire] = _dtypes.to_torch(wire)
        return dtype

    def _stage(self, _m, meta, dst) -> int:
        return self._stage_chunk(_m, meta, 1, dst)

    def _stage_chunk(self, _m, metas, n, dst) -> int:
        """Host staging for a chunk's n tensors, at a cost per chunk and per
        kind of tensor (dtype and shape) more than per tensor: their metas
        are read as one array, the small ones share one buffer, and only
        the names are read one by one. A large tensor gets its own."""
        def place(table: _MetaTable, chunk: _Chunk, kind: Any, offset: Any) -> Any:
            addrs = self.torch.zeros(n, dtype=self.torch.int64)
            small = (table.nbytes <= _SMALL).nonzero().flatten()
            if len(small):
                self._place_small(table, small, chunk, kind, offset, addrs)
            large = (table.nbytes > _SMALL).nonzero().flatten()
            if len(large):
                self._place_large(table, large, chunk, offset, addrs)
            addrs[table.nbytes == 0] = 0  # no bytes: nowhere to write
            C.memmove(dst, addrs.data_ptr(), 8 * n)
            return large
        return self._take_chunk(metas, n, "stage", place)

    def _adopt_chunk(self, _m, metas, n, src) -> int:
        """A chunk's n tensors where they lie in the worker's receive region
        (shm with many senders: the sender's copy the only one), viewed
        there until commit, which loads them: the small ones through typed
        views of one span of the region, as staged ones of a buffer; a
        large one a view of its own (narrowed as a staged one). A tensor
        not at a multiple of its element size cannot be viewed where it
        lies and is copied out."""
        def place(table: _MetaTable, chunk: _Chunk, kind: Any, offset: Any) -> Any:
            torch = self.torch
            chunk.adopted = True
            raw = (C.c_int64 * n).from_address(C.cast(src, C.c_void_p).value)
            addrs = torch.frombuffer(raw, dtype=torch.int64).clone()
            # From a line's start: the region's pages start on one.
            base = int(addrs.min()) & ~63
            end = (int((addrs + table.nbytes).max()) + 63) & ~63
            span = torch.frombuffer((C.c_uint8 * (end - base)).from_address(base),
                                    dtype=torch.uint8)
            offs = addrs - base
            fits = (offs % self.esizes[table.kind[:, 0]] == 0) & (table.nbytes > 0)
            small = (fits & (table.nbytes <= _SMALL)).nonzero().flatten()
            if len(small):
                self._view_kinds(table, small, chunk, kind, offset, span, offs[small])
            own = (~fits | (table.nbytes > _SMALL)).nonzero().flatten()
            if len(own):
                self._adopt_own(table, own, chunk, offset, span, offs, fits)
            return (fits & (table.nbytes > _SMALL)).nonzero().flatten()
        return self._take_chunk(metas, n, "adopt", place)

    def _take_chunk(self, metas: Any, n: int, what: str,
                    place: Callable[[_MetaTable, _Chunk, Any, Any], Any]) -> int:
        """A chunk's n tensors into the update: place sets each one's kind
        and offset (and the chunk's buffers or own tensors) and answers the
        positions of those to narrow (narrow_loads) once complete."""
        if n == 0:
            return 0
        try:
            torch = self.torch
            self.staged.narrow(self.loaded)
            table = _MetaTable(torch, metas, n)
            chunk = _Chunk(_meta_names(C.cast(metas, C.c_void_p).value, n))
            kind = torch.full((n,), -1, dtype=torch.int64)
            offset = torch.zeros(n, dtype=torch.int64)
            large = place(table, chunk, kind, offset)
            chunk.kind, chunk.offset = kind.tolist(), offset.tolist()
            self.staged.add_chunk(chunk)
            if len(large) and self.narrow_loads:
                self._mark_narrow(chunk, large.tolist(), "cpu")
            return 0
        except BaseException:  # noqa: BLE001 (a callback must not raise into C)
            log.exception(what)
            return _capi.ENOMEM

    def _adopt_own(self, table: _MetaTable, at: Any, chunk: _Chunk, offset: Any, span: Any,
                   offs: Any, fits: Any) -> None:
        """A tensor of its own for each of those at positions at: a view of
        span where it fits, else a copy out of it."""
        torch = self.torch
        first = len(chunk.own)
        rows = table.kind[at].tolist()
        for i, o, ok, row in zip(at.tolist(), offs[at].tolist(), fits[at].tolist(), rows):
            nb = int(table.nbytes[i])
            dtype, shape = self._torch_dtype(row[0]), row[2:2 + row[1]]
            if ok:
                t = span[o:o + nb].view(dtype).view(shape)
            else:
                t = torch.empty(shape, dtype=dtype)
                t.view(-1).view(torch.uint8).copy_(span[o:o + nb])
                self.staged.hold(nb)
            chunk.own.append(t)
        offset[at] = torch.arange(first, len(chunk.own), dtype=torch.int64)

    def _place_large(self, table: _MetaTable, large: Any, chunk: _Chunk, offset: Any,
                     addrs: Any) -> None:
        """A tensor of its own for each of the tensors at positions large (a
        tensor of indices), appended to chunk.own in order: their
        addresses into addrs, their places in own into offset. Their rows
        are read as one list and the results written back as two tensors:
        an element read or written one at a time costs microseconds, which
        thousands of tensors a sync turn into most of the sync."""
        torch = self.torch
        first = len(chunk.own)
        ptrs = []
        for row in table.kind[large].tolist():  # dtype, ndim, the shape's dims
            t = torch.empty(row[2:2 + row[1]], dtype=self._torch_dtype(row[0]))
            chunk.own.append(t)
            ptrs.append(t.data_ptr())
            self.staged.hold(t.nbytes)
        offset[large] = torch.arange(first, len(chunk.own), dtype=torch.int64)
        addrs[large] = torch.tensor(ptrs, dtype=torch.int64)

    def _place_small(self, table: _MetaTable, small: Any, chunk: _Chunk, kind: Any,
                     offset: Any, addrs: Any) -> None:
        """The tensors at positions small (a tensor of indices) in one new
        buffer, in order, each at a 16-byte boundary (as malloc's): their
        addresses into addrs, their kinds and element offsets into kind and
        offset, and each kind's typed view, shape and strides into chunk."""
        torch = self.torch
        room = (table.nbytes[small] + (_ALIGN - 1)) & ~(_ALIGN - 1)
        ends = torch.cumsum(room, 0)
        buf = torch.empty(max(int(ends[-1]), _ALIGN), dtype=torch.uint8)
        self.staged.hold(buf.nbytes)
        offs = ends - room
        addrs[small] = offs + buf.data_ptr()
        self._view_kinds(table, small, chunk, kind, offset, buf, offs)

    def _view_kinds(self, table: _MetaTable, at: Any, chunk: _Chunk, kind: Any, offset: Any,
                    buf: Any, offs: Any) -> None:
        """The tensors at positions at, at byte offsets offs of buf (each a
        multiple of its element size): their kinds and element offsets into
        kind and offset, and each kind's typed view, shape and strides into
        chunk."""
        kinds, kind_of = table.kinds(at)
        for k in kinds.tolist():
            shape = tuple(k[2:2 + k[1]])
            stride = [1] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                stride[d] = stride[d + 1] * shape[d + 1]
            chunk.typed.append(buf.view(self._torch_dtype(k[0])))
            chunk.shape.append(shape)
            chunk.stride.append(tuple(stride))
        kind[at] = kind_of
        offset[at] = offs // self.esizes[table.kind[at, 0]]

    def _mark_narrow(self, chunk: _Chunk, at: list[int], device: Any) -> None:
        """Of chunk's tensors at positions at (each of its own), those the
        loader reads only part of (or none of), to narrow once complete."""
        from . import _narrow
        loader = self._loader()
        if loader is None:
            return
        reads = self.reads.setdefault(getattr(loader, "__self__", self.module), {})
        own = [(i, chunk.own[chunk.offset[i]]) for i in at]
        new = [(chunk.names[i], t.dtype, tuple(t.shape)) for i, t in own
               if chunk.names[i] not in reads]
        if new:
            reads.update(_narrow.learn(loader, new, device))
        for i, _ in own:
            rule = reads[chunk.names[i]]
            if rule != _narrow.WHOLE:
                self.staged.to_narrow.append((chunk.first + i, chunk, chunk.offset[i], rule))

    def _stage_device(self, _m, meta, device, dst) -> int:
        # The C backend's copies into it run on its own CUDA stream and have
        # landed when the chunk's call returns, before commit reads it.
        try:
            m = meta[0]
            self.staged.narrow(self.loaded)
            t = self.torch.empty(m.shape[:m.ndim], dtype=self._torch_dtype(m.dtype),
                                 device=f"cuda:{device}")
            chunk = self.staged.add(m.name.decode(), t)
            if self.narrow_loads and t.nbytes > _SMALL:  # as on the host
                self._mark_narrow(chunk, [0], t.device)
            dst[0] = t.data_ptr() if t.numel() else 0
            return 0
        except BaseException:  # noqa: BLE001
            log.exception("stage")
            return _capi.ENOMEM

    def _loaded(self, _m, meta, _xxh3) -> int:
        return self._loaded_chunk(_m, meta, 1, _xxh3)

    def _loaded_chunk(self, _m, metas, n, _xxh3) -> int:
        try:
            self.loaded += n
            return 0
        except BaseException:  # noqa: BLE001 (a callback must not raise into C)
            log.exception("loaded")
            return _capi.EIO

    def _prepare(self, _m, version, err, errlen) -> int:
        if self.loaded < self.staged.n:
            first = self.staged.name_at(self.loaded)
            _capi.write_err(err, errlen, f"tensor '{first}' was staged but never completed")
            return _capi.ESTATE
        try:
            self.staged.narrow(self.loaded)
            return 0
        except BaseException as e:  # noqa: BLE001 (a callback must not raise into C)
            log.exception("prepare")
            _capi.write_err(err, errlen, f"cannot keep the slices the loader reads: {e}")
            return _capi.ENOMEM

    def _commit(self, _m, version) -> int:
        try:
            with self.lock, self.torch.no_grad():
                loader = self._loader()
                if loader is not None and self.base is not None:
                    kept = self.staged.kept()
                    loader(iter(kept))
                    self.base.update(kept)
                elif loader is not None:
                    loader(self.staged.items())  # each view made as it is read
                else:
                    targets = self._update_targets()
                    for name, t in self.staged.items():
                        targets[name].copy_(t)
                self.version = version.decode()
            self.staged.clear()
            self.update_targets = None
            return 0
        except BaseException:  # noqa: BLE001
            log.exception("commit")
            return _capi.EIO

    def _abort(self, _m) -> None:
        self.staged.clear()
        self.loaded = 0
        self.update_targets = None

    def _pause(self, _h, wait) -> None:
        if self.on_pause is not None:
            try:
                self.on_pause(bool(wait))
            except BaseException:  # noqa: BLE001
                log.exception("on_pause")

    def _resume(self, _h) -> None:
        if self.on_resume is not None:
            try:
                self.on_resume()
            except BaseException:  # noqa: BLE001
                log.exception("on_resume")


class Server:
    """A running worker (see ``serve``): ``port``, ``address``,
    ``version`` (of the weights last loaded), ``close()``; a context
    manager."""

    def __init__(self, host: _Host, worker: C.c_void_p, listen: str) -> None:
        self._host = host
        self._worker = worker
        self.port = _capi.worker_port(worker)
        self.address = f"{listen.rsplit(':', 1)[0]}:{self.port}"

    @property
    def version(self) -> str:
        with self._host.lock:
            return self._host.version

    @property
    def staged_peak_bytes(self) -> int:
        """The most bytes this host held staged at once in its last
        update: about the model's size for a whole replica; with
        ``narrow_loads``, its share of it, plus the tensors of a chunk in
        flight. Tensors read where they landed in the worker's receive
        region (shm with many senders) are not counted: that memory is the
        worker's, the size of its stream, made once at init."""
        return self._host.staged.peak

    def set_serving(self, serving: bool) -> None:
        """gRPC health: SERVING or NOT_SERVING (an engine not ready yet)."""
        _capi.worker_set_serving(self._worker, 1 if serving else 0)

    def close(self, grace_ms: int = 2000) -> None:
        """Stops serving: the active update (if any) is aborted and the
        module keeps its weights. Idempotent."""
        if self._worker:
            _capi.worker_drain(self._worker, grace_ms)
            _capi.worker_destroy(self._worker)
            self._worker = C.c_void_p()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _cuda_index(module: Any) -> int | None:
    """The CUDA device the module's first parameter (or buffer) is on, or
    None (CPU, or nothing to look at)."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if not t.is_cuda:
            return None
        if t.device.index is not None:
            return t.device.index
        import torch
        return torch.cuda.current_device()
    return None


def serve(model: Any, listen: str = "127.0.0.1:0", *, token_file: str | None = None,
          tls_cert: bytes | None = None, tls_key: bytes | None = None,
          tls_client_ca: bytes | None = None, backends: list[str] | None = None,
          on_pause: Callable[[bool], None] | None = None,
          on_resume: Callable[[], None] | None = None, watchdog_ms: int = 0,
          max_model_bytes: int = 0, max_params: int = 0, allow_upstream: str | None = None,
          reflection: str = "open", world_size: int = 1,
          cuda_device: int | None = None, shard_rules: str | None = None,
          tp_rank: int = 0, tp_size: int = 1, narrow_loads: bool = False,
          keep_base: bool = False) -> Server:
    """Hosts a wtx worker for ``model`` (a ``torch.nn.Module``) on ``listen``
    ("host:port"; port 0 picks one, see ``Server.port``). Trainers push
    with ``TrainerEngine`` or ``wtx push``; inspect with grpcurl. Options
    as ``wtx-worker``'s flags (--token-file, --tls-*, --backends,
    --watchdog-ms, --max-model-bytes, --max-params, --allow-upstream,
    --reflection); ``on_pause(wait_for_inflight)`` / ``on_resume()`` are
    called on Pause / Resume.

    GPU backends (cuda_ipc, nccl) receive on ``cuda_device`` (default: the
    device ``model`` is on, else ``WTX_CUDA_DEVICE``, else 0). A model on a
    GPU is staged on that GPU (device to device, no host copy); a model on
    the CPU is staged in host memory.

    A tensor-parallel rank holds only its parts: ``shard_rules`` is the text
    of a rule file (as ``wtx-worker --shard-rules``: one rule a line,
    "PATTERN whole|skip|expert E|dim D [unit U]"), ``tp_rank`` of ``tp_size``
    its place. Trainers then send it exactly those parts, and ``model``'s
    parameters of those names are loaded with the parts' shapes.

    ``narrow_loads``: trainers send whole tensors, but this host stages of
    each only what ``model.load_weights`` reads of it (as a vLLM
    tensor-parallel rank's loaders narrow), learned once a name by a dry
    run of ``load_weights`` over placeholders (``wtx._narrow``). Its
    staging then grows with its share of the model, plus the whole tensors
    of the chunk being received; tensors of 64 KiB or less are staged
    whole. For a rank whose trainer cannot learn its rules (vLLM's routes).

    ``keep_base``: a module with ``load_weights`` takes a delta's patches
    (``delta="patches"``, or the caller's own) instead of whole tensors.
    Its ``load_weights`` maps names, so the tensors it serves cannot be read
    back by their checkpoint names; this host keeps instead, in host
    memory, every tensor ``load_weights`` was last given (about the
    model's bytes), and the worker
    applies each patch to a copy of that. Staging is then on the host even
    for a module on a GPU (``load_weights`` copies to the device).
    ``load_weights`` must not write into the tensors it is given: a patch
    applied to a base that changed fails its checksum (DATA_LOSS), loudly.
    Not with ``narrow_loads``, whose ranks keep slices of whole tensors."""
    if reflection not in _REFLECTION:
        raise ValueError(f"reflection: one of {', '.join(_REFLECTION)}, got {reflection!r}")
    if keep_base and narrow_loads:
        raise ValueError("keep_base: a narrow_loads host keeps only the slices its loaders "
                         "read of each tensor, and a patch applies to the whole tensor")
    on_gpu = _cuda_index(model)
    if cuda_device is None:
        cuda_device = on_gpu
    host = _Host(model, on_pause, on_resume, device_staging=on_gpu is not None and not keep_base,
                 narrow_loads=narrow_loads, keep_base=keep_base)
    names = [b.encode() for b in backends] if backends else []
    arr = (C.c_char_p * max(len(names), 1))(*names) if names else None
    opts = _capi.WorkerOptions(
        listen=listen.encode(), backends=arr, n_backends=len(names),
        model_ops=C.pointer(host.ops), model=None, world_size=world_size,
        watchdog_ms=watchdog_ms, on_pause=host.pause_cb, on_resume=host.resume_cb, host=None,
        token_file=token_file.encode() if token_file else None, tls_cert_pem=tls_cert,
        tls_key_pem=tls_key, tls_client_ca_pem=tls_client_ca,
        reflection=_REFLECTION[reflection], max_model_bytes=max_model_bytes,
        max_params=max_params, allow_upstream=allow_upstream.encode() if allow_upstream else None,
        cuda_device=str(cuda_device).encode() if cuda_device is not None else None,
        shard_rules=shard_rules.encode() if shard_rules is not None else None,
        tp_rank=tp_rank, tp_size=tp_size)
    worker = C.c_void_p()
    err = C.create_string_buffer(_capi.ERRBUF)
    rc = _capi.worker_start(C.byref(opts), C.byref(worker), err, _capi.ERRBUF)
    if rc != 0:
        raise WtxError(f"wtx.serve: {_capi.message(rc, err.value)}")
    return Server(host, worker, listen)
