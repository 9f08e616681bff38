"""Weight sources with vLLM 0.33's ``WeightSource`` contract, and the
adapter that hands any of them to the C trainer engine.

A source has ``metadata`` (a ``functools.cached_property``: a list of
``ParamMeta``) and ``iter_full()`` (a fresh pass yielding ``(name, tensor)``
for exactly ``owned_names(rank)``, in metadata order). Any object of that
shape works, vLLM's own ``ModuleSource`` included. Tensors may be torch
(CPU or CUDA) or numpy; a CPU tensor that is contiguous is read in place,
the others are made contiguous (and host) once.
"""
from __future__ import annotations

import ctypes as C
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from . import _capi, _dtypes


@dataclass(frozen=True)
class ParamMeta:
    """One parameter: name, dtype, full shape, and which trainer ranks own
    it (vLLM 0.33's ``ParamMeta``; ``owners=None``: every rank)."""

    name: str
    dtype: Any
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Any, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.owners is not None:
            object.__setattr__(self, "owners", tuple(self.owners))


def owned_names(source: Any, rank: int) -> list[str]:
    """The names ``rank`` iterates: every parameter it owns, in metadata order."""
    if hasattr(source, "owned_names"):
        return list(source.owned_names(rank))
    return [m.name for m in source.metadata if m.owners is None or rank in m.owners]


class TorchModuleSource:
    """Like vLLM's ``ModuleSource``: the module's named parameters. A DTensor
    is gathered with ``full_tensor()`` in ``iter_full``, never for
    ``metadata``; its owners are its mesh's ranks."""

    def __init__(self, module: Any) -> None:
        self._module = module

    @cached_property
    def _taken(self) -> tuple[list[ParamMeta], bool]:
        """metadata, and whether none of its parameters is gathered (no
        DTensor type among them)."""
        metas, plain = [], True
        for name, p in self._module.named_parameters():
            plain = plain and not _gathered(type(p))
            owners, mesh_shape, placements = _layout(p)
            metas.append(ParamMeta(name, p.dtype, tuple(p.shape), owners=owners,
                                   mesh_shape=mesh_shape, placements=placements))
        return metas, plain

    @property
    def metadata(self) -> list[ParamMeta]:
        return self._taken[0]

    def owned_names(self, rank: int) -> list[str]:
        return owned_names(_Plain(self.metadata), rank)

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        # Without a DTensor when metadata was taken (which a pass must match
        # anyway), a pass is named_parameters() itself, with no step of ours
        # per tensor.
        if self._taken[1]:
            yield from self._module.named_parameters()
            return
        gathers: dict[type, bool] = {}  # per type
        for name, p in self._module.named_parameters():
            kind = type(p)
            gather = gathers.get(kind)
            if gather is None:
                gather = gathers[kind] = _gathered(kind)
            yield name, p.full_tensor() if gather else p


    def generation(self) -> int | None:
        """While this returns the same number, a pass yields the same
        parameter objects, by the same names, in the same order: it changes
        whenever any module registers a parameter or a submodule (assigning
        ``module.weight = Parameter(...)`` or a new layer), through torch's
        global registration hooks. None (never the same) where a pass makes
        tensors of its own (DTensors). An optimizer's in-place step keeps
        it; ``del module.weight`` and ``_parameters`` edited by hand are not
        seen (python/README.md)."""
        return _registrations() if self._taken[1] else None

    def iter_local(self) -> Iterator[tuple[str, Any]]:
        """This rank's part of each parameter it owns (a DTensor's
        ``to_local()``, as its placements say), for many senders: no
        gather."""
        for name, p in self._module.named_parameters():
            if getattr(p, "device_mesh", None) is None:
                yield name, p
            elif p.device_mesh.get_coordinate() is not None:
                yield name, p.to_local()


_registered = [0]
_hooks: list[Any] = []


def _registrations() -> int:
    """How many parameters and submodules any module has registered since
    the first call (the hooks are installed then, once per process)."""
    if not _hooks:
        from torch.nn.modules import module as tm

        def bump(*_: Any) -> None:
            _registered[0] += 1

        _hooks.append(tm.register_module_parameter_registration_hook(bump))
        _hooks.append(tm.register_module_module_registration_hook(bump))
    return _registered[0]


def _layout(p: Any) -> tuple[Any, Any, Any]:
    """(owners, mesh_shape, placements) of a DTensor as vLLM's ModuleSource
    declares them (placements None when not all plain Shard / Replicate), or
    three Nones for a plain tensor."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return None, None, None
    grid = mesh.mesh
    placements = []
    for pl in getattr(p, "placements", ()):
        kind = type(pl).__name__
        if kind not in ("Shard", "Replicate"):
            return tuple(grid.flatten().tolist()), tuple(grid.shape), None
        placements.append(pl)
    return tuple(grid.flatten().tolist()), tuple(grid.shape), tuple(placements)


def placement_code(p: Any) -> int:
    """A placement as wtx_ownership holds it: Shard(dim) (vLLM's or torch's:
    anything with an int ``dim``) as dim, anything else as replicated."""
    dim = getattr(p, "dim", None)
    return int(dim) if isinstance(dim, int) else _capi.PLACEMENT_REPLICATE


def ownership_array(metadata: list[Any]) -> tuple[Any, list]:
    """The ownership of every parameter as a C array of wtx_ownership, and
    the buffers it points to (kept alive by the caller)."""
    arr = (_capi.Ownership * max(len(metadata), 1))()
    keep: list = []
    for i, m in enumerate(metadata):
        owners = getattr(m, "owners", None)
        if owners is None:
            continue
        o = (C.c_uint32 * max(len(owners), 1))(*owners)
        keep.append(o)
        arr[i].owners = C.cast(o, C.POINTER(C.c_uint32))
        arr[i].n_owners = len(owners)
        mesh = getattr(m, "mesh_shape", None)
        if mesh is not None:
            ms = (C.c_uint32 * len(mesh))(*mesh)
            keep.append(ms)
            arr[i].mesh_shape = C.cast(ms, C.POINTER(C.c_uint32))
            arr[i].mesh_ndim = len(mesh)
        placements = getattr(m, "placements", None)
        if placements is not None:
            pl = (C.c_int32 * max(len(placements), 1))(*[placement_code(p) for p in placements])
            keep.append(pl)
            arr[i].placements = C.cast(pl, C.POINTER(C.c_int32))
    return arr, keep


def _gathered(kind: type) -> bool:
    """Whether a parameter of this type is sent gathered: a DTensor's type,
    which has full_tensor()."""
    return callable(getattr(kind, "full_tensor", None))


class DictSource:
    """``{name: tensor}`` (torch or numpy), in the dict's order."""

    holds_tensors = True  # the dict keeps them: sent from their own memory

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = dict(tensors)

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._tensors.items()]

    def owned_names(self, rank: int) -> list[str]:
        return list(self._tensors)

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        yield from self._tensors.items()


class SafetensorsSource:
    """One or more safetensors files, read by the C library (mapped, no copy
    through Python): ``metadata`` from their headers, ``iter_full`` yields
    numpy views (or, for bf16/fp8, torch tensors)."""

    def __init__(self, paths: str | Path | list[str | Path]) -> None:
        self.paths = [str(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        arr = (C.c_char_p * len(self.paths))(*[p.encode() for p in self.paths])
        src = C.c_void_p()
        err = C.create_string_buffer(_capi.ERRBUF)
        rc = _capi.source_safetensors(arr, len(self.paths), C.byref(src), err, _capi.ERRBUF)
        if rc != 0:
            raise ValueError(_capi.message(rc, err.value))
        self._c = src

    def __del__(self) -> None:
        if getattr(self, "_c", None):
            _capi.source_destroy(self._c)
            self._c = None

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = C.POINTER(_capi.TensorMeta)()
        n = C.c_size_t()
        _capi.source_metadata(self._c, C.byref(metas), C.byref(n))
        out = []
        for i in range(n.value):
            m = metas[i]
            out.append(ParamMeta(m.name.decode(), _dtypes.WIRE[m.dtype][0],
                                 tuple(m.shape[d] for d in range(m.ndim))))
        return out

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata]

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        from safetensors import safe_open  # reading tensors into Python needs it
        for path in self.paths:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


class _Plain:
    def __init__(self, metadata: list[ParamMeta]) -> None:
        self.metadata = metadata


# ---- the adapter: a Python source as a wtx_source ----

# What host_view found: a copy (valid until the next tensor), the tensor's
# own host memory, or its own CUDA memory (the C source API's 1, 2 and 3).
COPY, OWN_HOST, OWN_DEVICE = 1, 2, 3


def host_view(name: str, tensor: Any) -> tuple[int, int, Any, int]:
    """(address, bytes, keep-alive, kind) of the tensor's bytes: its own
    memory (OWN_HOST for a contiguous CPU tensor or array, OWN_DEVICE for a
    contiguous CUDA tensor), else one contiguous host copy (COPY)."""
    if hasattr(tensor, "data_ptr"):  # torch
        if tensor.is_cpu and tensor.is_contiguous():  # the common case, at once
            return tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor, OWN_HOST
        t = tensor.detach()
        if t.device.type == "cuda" and t.is_contiguous():
            return t.data_ptr(), t.numel() * t.element_size(), t, OWN_DEVICE
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        own = tensor.device.type == "cpu" and t.data_ptr() == tensor.data_ptr()
        return t.data_ptr(), t.numel() * t.element_size(), t, OWN_HOST if own else COPY
    import numpy as np
    a = np.ascontiguousarray(tensor)
    return a.ctypes.data, a.nbytes, a, OWN_HOST if a is tensor else COPY


def _torch_types() -> tuple[Any, Any]:
    """(torch.Tensor, torch.nn.Parameter), or two empty tuples (isinstance
    of nothing) without torch."""
    try:
        import torch
        return torch.Tensor, torch.nn.Parameter
    except ImportError:
        return (), ()


def held_elsewhere(source: Any, tensor: Any) -> bool:
    """Whether the tensor lives on after the pass without us (a module's
    parameter, or a source that holds its tensors): only then is it sent
    from its own memory and referenced until the pass ends. A tensor made
    for the pass (a gathered DTensor) is copied and let go at once."""
    return bool(getattr(source, "holds_tensors", False)) or isinstance(tensor, _torch_types()[1])


def meta_of(m: ParamMeta) -> tuple[int, tuple[int, ...]]:
    return _dtypes.to_wire(m.dtype), m.shape


class CSource:
    """A Python source behind wtx_source_ops: the C engine takes a pass in
    batches of tensors (next_batch: one callback per batch, not per tensor;
    the bytes never pass through Python). Keeps every callback and buffer
    alive as long as the C source lives."""

    def __init__(self, source: Any, rank: int = 0, world: int = 1) -> None:
        self.source = source
        metadata = list(source.metadata)
        # Many senders (world > 1): the whole table, with its ownership, and
        # a pass of this rank's parts (iter_local).
        self._local = world > 1
        if self._local and not callable(getattr(source, "iter_local", None)):
            raise ValueError("world_size > 1: the source must yield this rank's parts "
                             "(iter_local), as vLLM's ModuleSource and TorchModuleSource do")
        names = set(owned_names(source, rank))
        self.metas = metadata if self._local else [m for m in metadata if m.name in names]
        self.n = len(self.metas)
        self._arr = (_capi.TensorMeta * max(self.n, 1))()
        self._names = []
        err = C.create_string_buffer(_capi.ERRBUF)
        for i, m in enumerate(self.metas):
            wire, shape = meta_of(m)
            if len(shape) > _capi.MAX_DIMS:
                raise ValueError(f"parameter {m.name!r}: {len(shape)} dims, at most {_capi.MAX_DIMS}")
            nm = m.name.encode()
            self._names.append(nm)
            sh = (C.c_uint64 * max(len(shape), 1))(*shape)
            rc = _capi.tensor_meta_set(C.byref(self._arr[i]), nm, wire, sh, len(shape), err,
                                       _capi.ERRBUF)
            if rc != 0:
                raise ValueError(f"parameter {m.name!r}: {_capi.message(rc, err.value)}")
        # What each tensor of a pass must be, in order: a tensor that is
        # (name, wire dtype, shape, bytes) is handed to the engine as _arr's
        # entry (its address) without building a meta; any other is
        # described as it is, so the engine reports how it disagrees.
        base, size = C.addressof(self._arr), C.sizeof(_capi.TensorMeta)
        self._meta_at = [base + i * size for i in range(self.n)]
        # The last field, metadata's own dtype, is for _next_batch's fast
        # case: torch's dtypes are singletons, so `is` compares them; one of
        # another kind (numpy's, a name) is never a tensor's: never fast.
        self._expect = [(m.name, self._arr[i].dtype, m.shape, self._arr[i].nbytes, m.dtype)
                        for i, m in enumerate(self.metas)]
        self._wire_of: dict[Any, int] = {}
        self._holds = bool(getattr(source, "holds_tensors", False))
        self._tensor, self._param = _torch_types()
        self._pos: dict[int, int] = {}
        self._iters: dict[int, Iterator] = {}
        # Per pass: what the last batch handed out and must keep alive until
        # the next (copies, described metas), and the tensors yielded in
        # place, kept until close (next_batch said 2: they stay put).
        self._held: dict[int, list] = {}
        self._in_place: dict[int, list] = {}
        self._next_iter = 1
        # A pass replayed from a table (_replay): what the last pass handed
        # the engine, kept when every tensor of it went in place as
        # metadata describes it, for a source whose generation() says when
        # its tensors may have changed. _rec: the pass being recorded.
        self._generation = getattr(source, "generation", None)
        self._table: tuple | None = None
        self._rec: dict[int, tuple] = {}
        self.error: BaseException | None = None
        self._own, self._own_keep = ownership_array(self.metas) if self._local else (None, [])
        self._ops = _capi.SourceOps(_capi.SOURCE_OPS_VERSION, b"python",
                                    _capi.SRC_METADATA(self._metadata),
                                    _capi.SRC_OPEN(self._open), _capi.SRC_NEXT(),
                                    _capi.SRC_CLOSE(self._close), _capi.SRC_DESTROY(self._destroy),
                                    _capi.SRC_NEXT_BATCH(self._next_batch),
                                    _capi.SRC_OWNERSHIP(self._ownership) if self._local
                                    else _capi.SRC_OWNERSHIP())
        self.c = C.c_void_p()
        rc = _capi.source_create(C.byref(self._ops), None, C.byref(self.c))
        if rc != 0:
            raise MemoryError(_capi.message(rc))

    def close(self) -> None:
        if self.c:
            _capi.source_destroy(self.c)
            self.c = C.c_void_p()

    def _metadata(self, _self, metas, n) -> int:
        metas[0] = C.cast(self._arr, C.POINTER(_capi.TensorMeta))
        n[0] = self.n
        return 0

    def _ownership(self, _self, owners, n) -> int:
        owners[0] = C.cast(self._own, C.POINTER(_capi.Ownership))
        n[0] = self.n
        return 0

    def _open(self, _self, it) -> int:
        try:
            key = self._next_iter
            self._next_iter += 1
            self._pos[key] = 0
            gen = self._generation() if self._generation is not None else None
            table = self._replay(gen)
            if table is not None:
                self._iters[key] = None  # next_batch answers from the table
                self._in_place[key] = table[1]
            else:
                passes = self.source.iter_local if self._local else self.source.iter_full
                self._iters[key] = iter(passes())
                self._in_place[key] = []
                if gen is not None:
                    self._rec[key] = (gen, [], [], [], [True])
            it[0] = key
            return 0
        except BaseException as e:  # noqa: BLE001 (reported by the engine)
            self.error = e
            return _capi.EIO

    def _replay(self, gen: Any) -> tuple | None:
        """The last recorded pass, when this one would hand the engine the
        same: the source's generation is the one it was recorded at, and
        every tensor's storage is where it was (an optimizer's step writes
        in place; ``p.data = ...`` moves it). One call per tensor, no pass
        over the source."""
        t = self._table
        if t is None or gen is None or gen != t[0]:
            return None
        # map over the unbound method: a fifth cheaper than a call per bound one
        return t if list(map(self._tensor.data_ptr, t[1])) == t[2] else None

    def _replayed(self, key: int, most: int, metas: int, data: int, kinds: int) -> int:
        _gen, _tensors, _ptrs, arrays = self._table
        i = self._pos[key]
        k = min(most, self.n - i)
        for arr, out, size in zip(arrays, (metas, data, kinds),
                                  (C.sizeof(C.c_void_p), C.sizeof(C.c_void_p), C.sizeof(C.c_int))):
            C.memmove(out, C.addressof(arr) + i * size, k * size)
        self._pos[key] = i + k
        return k

    def _record(self, key: int, m_out: list, d_out: list, k_out: list, ended: bool) -> None:
        """Adds a batch to the pass being recorded; at its end, a pass whose
        every tensor went in place as metadata describes it becomes the
        table the next pass may replay."""
        gen, ms, ds, ks, ok = self._rec[key]
        ms += m_out
        ds += d_out
        ks += k_out
        if not ended:
            return
        del self._rec[key]
        if ok[0] and len(ms) == self.n and gen == self._generation():
            tensors = list(self._in_place[key])
            self._table = (gen, tensors, list(map(self._tensor.data_ptr, tensors)),
                           ((C.c_void_p * max(self.n, 1))(*ms), (C.c_void_p * max(self.n, 1))(*ds),
                            (C.c_int * max(self.n, 1))(*ks)))

    def _next_batch(self, _self, it, most, metas, data, kinds) -> int:
        """Up to most tensors of the pass into the engine's arrays; a batch
        ends at a copy, so that one copy at a time is alive. The loop is a
        model's whole per-tensor cost in Python: kept to a few calls."""
        key = it or 0
        try:
            held = self._held[key] = []  # the last batch's copies go
            if self._iters[key] is None:
                return self._replayed(key, most, metas, data, kinds)
            rec = self._rec.get(key)
            tensors, in_place, i = self._iters[key], self._in_place[key], self._pos[key]
            tensor_t, param_t, holds = self._tensor, self._param, self._holds
            expect, meta_at, n = self._expect, self._meta_at, self.n
            m_out: list[int] = []
            d_out: list[int] = []
            k_out: list[int] = []
            k = 0
            ended = False
            while k < most:
                item = next(tensors, None)
                if item is None:
                    ended = True
                    break
                name, tensor = item
                k += 1
                cls = tensor.__class__
                # The commonest case first, in the fewest calls (each is paid
                # once per tensor per sync): a module's own parameter on the
                # host, exactly as metadata describes it (same name, dtype
                # object and shape: so the same bytes too).
                if ((cls is param_t or (holds and cls is tensor_t)) and i < n
                        and tensor.is_cpu and tensor.is_contiguous()
                        and name == expect[i][0] and tensor.dtype is expect[i][4]
                        and tensor.shape == expect[i][2]):
                    in_place.append(tensor)
                    meta, addr, kind = meta_at[i], tensor.data_ptr(), OWN_HOST
                else:
                    if rec is not None:
                        rec[4][0] = False  # this pass is not replayed
                    if (isinstance(tensor, tensor_t) and tensor.is_cpu
                            and tensor.is_contiguous() and (holds or isinstance(tensor, param_t))):
                        in_place.append(tensor)  # sent from its own memory
                        addr, nbytes, kind = tensor.data_ptr(), tensor.nbytes, OWN_HOST
                    else:
                        addr, nbytes, kind = self._view(name, tensor, held, in_place)
                    meta = self._meta(i, name, tensor, nbytes, held)
                m_out.append(meta)
                d_out.append(addr)
                k_out.append(kind)
                i += 1
                if kind == COPY:
                    break
            self._pos[key] = i
            if rec is not None:
                self._record(key, m_out, d_out, k_out, ended)
            if k:
                (C.c_void_p * k).from_address(metas)[:] = m_out
                (C.c_void_p * k).from_address(data)[:] = d_out
                (C.c_int * k).from_address(kinds)[:] = k_out
            return k
        except BaseException as e:  # noqa: BLE001
            self.error = e
            return _capi.EIO

    def _view(self, name: str, tensor: Any, held: list, in_place: list) -> tuple[int, int, int]:
        """Any tensor but a contiguous host one held elsewhere: (address,
        bytes, kind) of its bytes, a copy where they are not its own or it
        is not kept (held until the next batch)."""
        addr, nbytes, keep, kind = host_view(name, tensor)
        if kind != COPY and not held_elsewhere(self.source, tensor):
            if kind == OWN_DEVICE:  # a host copy, let go at the next batch
                addr, nbytes, keep, kind = host_view(name, keep.to("cpu"))
            kind = COPY
        (held if kind == COPY else in_place).append(keep)
        return addr, nbytes, kind

    def _wire(self, dtype: Any) -> int:
        wire = self._wire_of.get(dtype)
        if wire is None:
            wire = self._wire_of[dtype] = _dtypes.to_wire(dtype)
        return wire

    def _meta(self, i: int, name: str, tensor: Any, nbytes: int, held: list) -> int:
        """The address of the pass's i-th tensor's meta: metadata's i-th
        when the tensor is that one as described (name, dtype, shape,
        bytes), else one describing it as it is."""
        if i < self.n:
            want = self._expect[i]
            if (name == want[0] and tensor.shape == want[2] and nbytes == want[3]
                    and self._wire(tensor.dtype) == want[1]):
                return self._meta_at[i]
        return self._describe(held, name, tensor, nbytes)

    def _describe(self, held: list, name: str, tensor: Any, nbytes: int) -> int:
        """The address of a meta of the tensor as it is (kept in held until
        the next batch; the engine then says how it disagrees)."""
        nm = name.encode()
        meta = _capi.TensorMeta()
        held += (nm, meta)
        wire = _dtypes.to_wire(tensor.dtype)
        shape = tuple(int(d) for d in tensor.shape)
        sh = (C.c_uint64 * max(len(shape), 1))(*shape)
        err = C.create_string_buffer(_capi.ERRBUF)
        rc = _capi.tensor_meta_set(C.byref(meta), nm, wire, sh, len(shape), err, _capi.ERRBUF)
        if rc != 0:
            raise ValueError(f"tensor {name!r}: {_capi.message(rc, err.value)}")
        if meta.nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {nbytes} bytes for {meta.nbytes}")
        return C.addressof(meta)

    def _close(self, _self, it) -> None:
        key = it or 0
        self._iters.pop(key, None)
        self._pos.pop(key, None)
        self._rec.pop(key, None)
        self._held.pop(key, None)
        self._in_place.pop(key, None)

    def _destroy(self, _self) -> None:
        self._table = None
        self._rec.clear()
        self._iters.clear()
        self._held.clear()
        self._in_place.clear()


def total_bytes(metas: list[ParamMeta]) -> int:
    return sum(math.prod(m.shape) * _dtypes.element_size(_dtypes.to_wire(m.dtype)) for m in metas)
