"""What a model's ``load_weights`` reads of each checkpoint tensor, so a
host can stage only that (``serve(..., narrow_loads=True)``).

A tensor-parallel rank of vLLM receives whole checkpoint tensors (vLLM's
routes give every rank the same messages) and its loaders keep a slice of
each: ``loaded_weight.narrow(dim, start, length)``, then ``param.copy_``.
Staging the whole tensors until commit would hold the whole model on every
rank. Instead, each name is learned once: ``load_weights`` runs over a
placeholder (``_Slice``, a tensor subclass with the checkpoint tensor's
metadata and no data) that records the box its narrows reach when it is
copied from. The host then keeps that box of the received tensor, and at
commit hands the loader a placeholder again, whose narrows into the box
answer with the kept bytes. Anything else a loader does with the
placeholder (arithmetic, a view other than a narrow or a plain slice) makes
the name "whole": staged and loaded as before. A name the loader reads
none of (another rank's expert, a tied weight) is kept as nothing and not
loaded. At commit a read outside the kept box is an error naming the
tensor, never bytes the rank does not hold.
"""
from __future__ import annotations

from typing import Any

import torch

WHOLE = "whole"
NOTHING = "nothing"

# Metadata a loader may read from a placeholder.
_META = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_contiguous,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.__hash__,
})


class _Unrecordable(Exception):
    pass


class _Slice(torch.Tensor):
    """A placeholder for the box ``box`` ([(start, length)] per dim) of
    checkpoint tensor ``name``. Recording (``part`` None): a copy from it
    adds its box to ``seen``. Loading: a narrow within ``kept`` (the box
    ``part`` holds) answers with ``part``'s bytes."""

    @staticmethod
    def __new__(cls, name: str, box: list[tuple[int, int]], dtype: Any, device: Any,
                seen: list | None, part: Any = None, kept: list | None = None) -> "_Slice":
        t = torch.Tensor._make_wrapper_subclass(cls, [n for _, n in box], dtype=dtype,
                                                device=device)
        t.key, t.box, t.seen, t.part, t.kept = name, box, seen, part, kept
        return t

    def _narrowed(self, dim: int, start: int, length: int) -> Any:
        dim %= len(self.box)
        start = int(start) + (self.box[dim][1] if int(start) < 0 else 0)
        if start < 0 or length < 0 or start + length > self.box[dim][1]:
            raise IndexError(f"narrow({dim}, {start}, {length}) past {self.key}'s "
                             f"{[n for _, n in self.box]}")
        box = list(self.box)
        box[dim] = (box[dim][0] + start, int(length))
        if self.part is None:
            return _Slice(self.key, box, self.dtype, self.device, self.seen)
        return self._read(box)

    def _read(self, box: list[tuple[int, int]]) -> Any:
        """The bytes of box from the kept part, or an error naming the
        tensor when they are not all kept."""
        out = self.part
        for d, ((s, n), (ks, kn)) in enumerate(zip(box, self.kept)):
            if s < ks or s + n > ks + kn:
                raise RuntimeError(
                    f"the model's loader reads '{self.key}' beyond the slice this rank "
                    f"keeps (dim {d}: [{s}, {s + n}) of the kept [{ks}, {ks + kn})): "
                    "its load_weights reads differently than when it was learned")
            if (s, n) != (ks, kn):
                out = out.narrow(d, s - ks, n)
        return out

    def _sliced(self, key: Any) -> Any:
        """t[a:b, c:d, ...]: narrows with step 1; anything else refused."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(self.box) or not all(isinstance(k, slice) for k in key):
            raise _Unrecordable("__getitem__")
        out: Any = self
        for d, k in enumerate(key):
            if k.step not in (None, 1):
                raise _Unrecordable("__getitem__")
            start, stop, _ = k.indices(self.box[d][1])
            out = out.narrow(d, start, max(stop - start, 0))
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.narrow, torch.narrow) and isinstance(args[0], _Slice):
            a = list(args[1:]) + [kwargs[k] for k in ("dim", "start", "length") if k in kwargs]
            return args[0]._narrowed(*a)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], _Slice):
            return args[0]._sliced(args[1])
        if func is torch.Tensor.copy_ and isinstance(args[1], _Slice):
            src = args[1]
            if src.part is not None:
                return args[0].copy_(src._read(src.box), **kwargs)
            src.seen.append(list(src.box))
            return args[0]
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        what = getattr(func, "__name__", str(func))
        for a in args:
            if isinstance(a, _Slice) and a.part is not None:
                raise RuntimeError(f"the model's loader applies {what} to '{a.key}', of "
                                   "which this rank keeps only a slice")
        raise _Unrecordable(what)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _Unrecordable(str(func))


def _union(boxes: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The smallest box holding all of boxes."""
    out = []
    for dims in zip(*boxes):
        lo = min(s for s, _ in dims)
        out.append((lo, max(s + n for s, n in dims) - lo))
    return out


def learn(load_weights: Any, metas: list[tuple[str, Any, tuple[int, ...]]],
          device: Any = "cpu") -> dict[str, Any]:
    """What load_weights reads of each (name, torch dtype, shape) in
    metas, staged on device: a box [(start, length)] per dim, WHOLE or
    NOTHING. One call over them all; where it raises, or leaves names of
    the iterator untaken, one call per name, and a name whose call raises
    or does not take it is WHOLE (its real load will do the same)."""
    seen: dict[str, list] = {name: [] for name, _, _ in metas}
    taken: set[str] = set()

    def placeholders(which):
        for name, dtype, shape in which:
            taken.add(name)
            yield name, _Slice(name, [(0, n) for n in shape], dtype, device, seen[name])

    def run(which) -> bool:
        try:
            with torch.no_grad():
                load_weights(placeholders(which))
            return True
        except Exception:  # noqa: BLE001 (any failure: the name stays whole)
            return False

    whole: set[str] = set()
    if not run(metas) or len(taken) < len(metas):
        for m in metas:
            seen[m[0]].clear()
            taken.discard(m[0])
            if not run([m]) or m[0] not in taken:
                whole.add(m[0])
    out: dict[str, Any] = {}
    for name, _, shape in metas:
        box = _union(seen[name]) if seen[name] else None
        if name in whole or box == [(0, n) for n in shape]:
            out[name] = WHOLE
        else:
            out[name] = NOTHING if box is None else box
    return out


def keep(name: str, whole: Any, box: list[tuple[int, int]]) -> Any:
    """The placeholder load_weights gets for name at commit: box of whole
    (a staged tensor), copied out so whole can be freed."""
    part = whole
    for d, (s, n) in enumerate(box):
        part = part.narrow(d, s, n)
    part = part.clone()
    return _Slice(name, [(0, n) for n in whole.shape], whole.dtype, whole.device, None,
                  part, box)
