"""Stand-ins for CUDA tensors in CPU tests of the epilogue call checks: a dtype, an element count,
an address and a device, and nothing else."""

from __future__ import annotations

from typing import Any

import torch


class FakeCudaTensor:
    """A contiguous 'CUDA' tensor of ``numel`` elements of ``dtype`` at ``ptr`` on ``device``."""

    is_cuda = True

    def __init__(self, dtype: Any, numel: int, ptr: int, device: int = 0, contiguous: bool = True) -> None:
        self.dtype = dtype
        self._n = numel
        self._ptr = ptr
        self._dev = device
        self._contig = contiguous

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._dev)

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._n

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self._n])

    def dim(self) -> int:
        return 1

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def get_device(self) -> int:
        return self._dev

    def is_contiguous(self) -> bool:
        return self._contig
