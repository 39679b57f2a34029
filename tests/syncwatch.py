"""`SyncWatch`: count host-synchronising and data-dependent ops, and all dispatched ops, through torch's dispatcher.

A GPU step stalls when the host must wait for a device result: reading a value (``.item()``, ``float(t)``,
``bool(t)``, ``if t:``), an op whose output shape depends on the data (``nonzero``, ``unique``, boolean-mask
indexing, ``masked_select``, ``repeat_interleave`` without ``output_size``), a comparison answered on the host
(``torch.equal``), or a blocking copy between devices. Each of these passes through the dispatcher as an aten op,
on a CPU exactly as on a GPU, so a `TorchDispatchMode` sees all of them in a CPU test, in forward and (when
``backward()`` runs inside the mode) in autograd's backward too. Patching a few Tensor methods would miss the ops
reached from C++ (``torch.equal``, indexing, ``unique``'s sizes).

Copies between devices: a ``_to_copy`` or ``copy_`` whose source and destination devices differ and that is not
``non_blocking`` is recorded. On a CPU-only run every tensor is on the CPU, so such copies are rare there (a test
that wants them counted puts one side on the ``meta`` device); the data-dependent ops are what a CPU run catches.
``Tensor.tolist()`` and ``Tensor.numpy()`` dispatch nothing for a CPU tensor, so the mode wraps those two methods
while it is active and records each call. A constant made with ``torch.tensor(value, device=gpu)`` is a blocking
copy that a CPU run cannot see (its tensors are on the CPU): build constants with ``torch.full`` instead.

Usage::

    with SyncWatch() as w:
        loss = fn(x)
        loss.backward()
    assert w.count == 0, w.summary()
    w.op_count  # every dispatched aten op (forward and backward): an upper bound on kernel launches
"""

from __future__ import annotations

import collections
import functools
import os
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {
    "aten::_local_scalar_dense",  # item(), float(t), int(t), bool(t)
    "aten::nonzero",
    "aten::equal",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::bincount",  # the output length is the input's maximum
}
_BOOL_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
                 "aten::_index_put_impl"}
_COPIES = {"aten::_to_copy", "aten::copy_", "aten::copy"}
_HOST_READS = ("tolist", "numpy")

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _has_bool_index(indices: Any) -> bool:
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _device_of(x: Any) -> Optional[torch.device]:
    return x.device if torch.is_tensor(x) else None


def _arg(func, args: Tuple, kwargs: Dict, name: str) -> Any:
    """The value of argument `name` of an aten call, positional or keyword (None when absent)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return None


def _why(func, args: Tuple, kwargs: Dict) -> Optional[str]:
    """The reason an op synchronises with the host, or None."""
    name = func._schema.name
    if name in _ALWAYS or name.startswith("aten::unique"):
        return "data-dependent"
    if name in _BOOL_INDEXED:
        return "boolean index" if _has_bool_index(_arg(func, args, kwargs, "indices")) else None
    if name == "aten::repeat_interleave":
        # The Tensor-repeats overloads size their output by repeats.sum() unless output_size is given.
        tensor_repeats = torch.is_tensor(_arg(func, args, kwargs, "repeats")) or func._overloadname == "Tensor"
        return "data-dependent" if tensor_repeats and _arg(func, args, kwargs, "output_size") is None else None
    if name in _COPIES:
        if name == "aten::_to_copy":
            src, dst = _device_of(args[0]), kwargs.get("device")
        else:
            dst, src = _device_of(args[0]), _device_of(_arg(func, args, kwargs, "src"))
        non_blocking = _arg(func, args, kwargs, "non_blocking")
        if dst is not None and src is not None and torch.device(dst) != src and not non_blocking:
            return f"blocking copy {src}->{torch.device(dst)}"
    return None


def _location() -> str:
    """The innermost caller outside torch and this file, as ``path:line (function)``, path relative to the
    working directory when inside it; autograd's own frames are skipped so a backward op names the user frame
    (an autograd.Function's backward, or the ``backward()`` call)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            continue
        rel = os.path.relpath(path)
        return f"{path if rel.startswith('..') else rel}:{frame.lineno} ({frame.name})"
    return "<torch>"


class SyncWatch(TorchDispatchMode):
    """A dispatch mode that records host-synchronising ops and counts every dispatched op.

    Attributes:
        events: list of (op name, location) for each synchronising op, in order.
        op_count: number of aten ops dispatched while the mode was active (views and factory calls included).
        op_counts: Counter of op name -> calls, for all ops.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: List[Tuple[str, str]] = []
        self.reasons: List[str] = []
        self.op_count = 0
        self.op_counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.op_count += 1
        self.op_counts[name] += 1
        why = _why(func, args, kwargs)
        if why is not None:
            self.events.append((name, _location()))
            self.reasons.append(why)
        return func(*args, **kwargs)

    def __enter__(self):
        # Tensor.tolist() and .numpy() read a CPU tensor's memory without dispatching any op (on a GPU tensor they
        # dispatch the blocking copy to the CPU first): recorded by wrapping the two methods while the mode is on.
        self._saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._host_read(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)

    def _host_read(self, name: str, original):
        watch = self

        @functools.wraps(original)
        def read(tensor, *args, **kwargs):
            watch.events.append((f"Tensor.{name}", _location()))
            watch.reasons.append("host read")
            return original(tensor, *args, **kwargs)

        return read

    @property
    def count(self) -> int:
        """Number of synchronising ops recorded."""
        return len(self.events)

    def summary(self) -> str:
        """The events grouped by (op, location), most frequent first, one line each; then the op total."""
        groups = collections.Counter(zip((e[0] for e in self.events), (e[1] for e in self.events), self.reasons))
        lines = [f"{n:5d} x {op} [{why}] at {where}" for (op, where, why), n in groups.most_common()]
        lines.append(f"{self.count} synchronising op(s) among {self.op_count} dispatched")
        return "\n".join(lines)
