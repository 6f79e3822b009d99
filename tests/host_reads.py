"""Counting host reads (what stalls CUDA: a device value read back by the host) on the CPU."""
import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose result the host must wait for: a scalar read back, or an output whose shape depends on the values
SYNCING = {aten._local_scalar_dense.default: "item/int/bool/float", aten.nonzero.default: "nonzero",
           aten.masked_select.default: "masked_select", aten.is_nonzero.default: "is_nonzero",
           aten.equal.default: "equal", aten.unique_consecutive.default: "unique", aten._unique2.default: "unique",
           aten.repeat_interleave.Tensor: "repeat_interleave"}


class HostReadCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING:
            self.counts[SYNCING[func]] += 1
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.counts["boolean index"] += 1
        return func(*args, **kwargs)

    @property
    def total(self):
        return sum(self.counts.values())


@contextlib.contextmanager
def count_host_reads():
    counter = HostReadCounter()
    original = torch.Tensor.tolist

    def tolist(self):
        counter.counts["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original
