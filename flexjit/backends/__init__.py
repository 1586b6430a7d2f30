"""Backends: each renders a Program into a kernel (or, for the reference, evaluates it)."""
import functools

import torch


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, looked up once per device: torch's own query costs
    ~10 µs, and every call asks it several times (dispatch, each backend's supports, the plan)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
