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
    def metadata(self) -> list[ParamMeta]:
        metas = []
        for name, p in self._module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            owners = tuple(mesh.mesh.flatten().tolist()) if mesh is not None else None
            metas.append(ParamMeta(name, p.dtype, tuple(p.shape), owners=owners))
        return metas

    def owned_names(self, rank: int) -> list[str]:
        return owned_names(_Plain(self.metadata), rank)

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        for name, p in self._module.named_parameters():
            full = getattr(p, "full_tensor", None)
            yield name, full() if callable(full) else p


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


def held_elsewhere(source: Any, tensor: Any) -> bool:
    """Whether the tensor lives on after the pass without us (a module's
    parameter, or a source that holds its tensors): only then is it sent
    from its own memory and referenced until the pass ends. A tensor made
    for the pass (a gathered DTensor) is copied and let go at once."""
    if getattr(source, "holds_tensors", False):
        return True
    try:
        import torch
        return isinstance(tensor, torch.nn.Parameter)
    except ImportError:
        return False


def meta_of(m: ParamMeta) -> tuple[int, tuple[int, ...]]:
    return _dtypes.to_wire(m.dtype), m.shape


class CSource:
    """A Python source behind wtx_source_ops: the C engine calls back once
    per tensor (the bytes never pass through Python). Keeps every callback
    and buffer alive as long as the C source lives."""

    def __init__(self, source: Any, rank: int = 0) -> None:
        self.source = source
        metadata = list(source.metadata)
        names = set(owned_names(source, rank))
        self.metas = [m for m in metadata if m.name in names]
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
        # (name, wire dtype, shape, bytes) gets its TensorMeta from _arr
        # without building one; any other is described as it is, so the
        # engine reports how it disagrees with the metadata.
        self._wire_of: dict[Any, int] = {}
        self._pos: dict[int, int] = {}
        self._iters: dict[int, Iterator] = {}
        # Per pass: the tensor (and name) of the last next, and the tensors
        # yielded in place, kept until close (next said 2: they stay put).
        self._held: dict[int, Any] = {}
        self._in_place: dict[int, list] = {}
        self._next_iter = 1
        self.error: BaseException | None = None
        self._ops = _capi.SourceOps(b"python", _capi.SRC_METADATA(self._metadata),
                                    _capi.SRC_OPEN(self._open), _capi.SRC_NEXT(self._next),
                                    _capi.SRC_CLOSE(self._close), _capi.SRC_DESTROY(self._destroy))
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

    def _open(self, _self, it) -> int:
        try:
            key = self._next_iter
            self._next_iter += 1
            self._iters[key] = iter(self.source.iter_full())
            self._pos[key] = 0
            it[0] = key
            return 0
        except BaseException as e:  # noqa: BLE001 (reported by the engine)
            self.error = e
            return _capi.EIO

    def _next(self, _self, it, meta, data) -> int:
        key = it or 0
        try:
            self._held.pop(key, None)
            item = next(self._iters[key], None)
            if item is None:
                return 0
            name, tensor = item
            i = self._pos[key]
            self._pos[key] = i + 1
            addr, nbytes, keep, kind = host_view(name, tensor)
            if kind != COPY and not held_elsewhere(self.source, tensor):
                if kind == OWN_DEVICE:  # a host copy, let go at the next tensor
                    addr, nbytes, keep, kind = host_view(name, keep.to("cpu"))
                kind = COPY
            self._held[key] = keep
            if kind != COPY:
                self._in_place.setdefault(key, []).append(keep)
            if i < self.n and self._as_described(i, name, tensor, nbytes):
                meta[0] = self._arr[i]
            else:
                self._describe(key, name, tensor, nbytes, meta)
            data[0] = addr
            return kind
        except BaseException as e:  # noqa: BLE001
            self.error = e
            return _capi.EIO

    def _as_described(self, i: int, name: str, tensor: Any, nbytes: int) -> bool:
        """Whether the pass's i-th tensor is metadata's i-th, as described."""
        wire = self._wire_of.get(tensor.dtype)
        if wire is None:
            wire = self._wire_of[tensor.dtype] = _dtypes.to_wire(tensor.dtype)
        a = self._arr[i]
        return (name == self.metas[i].name and wire == a.dtype
                and tuple(tensor.shape) == self.metas[i].shape and nbytes == a.nbytes)

    def _describe(self, key: int, name: str, tensor: Any, nbytes: int, meta: Any) -> None:
        """meta as the tensor is (the engine then says how it disagrees)."""
        nm = name.encode()
        self._held[-key] = nm
        wire = _dtypes.to_wire(tensor.dtype)
        shape = tuple(int(d) for d in tensor.shape)
        sh = (C.c_uint64 * max(len(shape), 1))(*shape)
        err = C.create_string_buffer(_capi.ERRBUF)
        rc = _capi.tensor_meta_set(meta, nm, wire, sh, len(shape), err, _capi.ERRBUF)
        if rc != 0:
            raise ValueError(f"tensor {name!r}: {_capi.message(rc, err.value)}")
        if meta[0].nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {nbytes} bytes for {meta[0].nbytes}")

    def _close(self, _self, it) -> None:
        key = it or 0
        self._iters.pop(key, None)
        self._pos.pop(key, None)
        self._held.pop(key, None)
        self._held.pop(-key, None)
        self._in_place.pop(key, None)

    def _destroy(self, _self) -> None:
        self._iters.clear()
        self._held.clear()
        self._in_place.clear()


def total_bytes(metas: list[ParamMeta]) -> int:
    return sum(math.prod(m.shape) * _dtypes.element_size(_dtypes.to_wire(m.dtype)) for m in metas)
