"""What this node can run ranks on: the CPUs this process may use and torch's accelerators.

``--nproc-per-node`` words resolve here, as torchrun resolves them: ``cpu`` counts the CPUs
the process may run on (its affinity mask: ``taskset`` and cgroup cpusets shrink it), not the
machine's; ``auto`` is one rank per accelerator of torch's current accelerator (CUDA, XPU,
MPS, a PrivateUse1 backend) when one is available, else one per usable CPU; ``gpu`` and
``xpu`` name a device type that must be available. torch is imported only for the words.
"""

from __future__ import annotations

import os

from hyperpodrun.errors import ConfigError

__all__ = ["DEVICE_WORDS", "accelerator_count", "ranks_for", "usable_cpus"]

#: The ``--nproc-per-node`` words besides a number (a PrivateUse1 backend's name is accepted too).
DEVICE_WORDS = ("auto", "cpu", "gpu", "xpu")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), as torch's ``cpu_count`` counts them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def accelerator_count() -> tuple[int, str]:
    """(devices, type) of torch's current accelerator; (0, "cpu") when none is available."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        return accelerator.device_count(), current.type if current is not None else "accelerator"
    if torch.cuda.is_available():  # torch releases before the accelerator API
        return torch.cuda.device_count(), "cuda"
    return 0, "cpu"


def ranks_for(word: str) -> int:
    """Ranks per node for a ``--nproc-per-node`` word; ConfigError when it names no available device."""
    if word == "cpu":
        return usable_cpus()
    if word == "auto":
        count, _ = accelerator_count()
        return count if count > 0 else usable_cpus()
    import torch

    if word == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--nproc-per-node gpu: no CUDA device is available")
        return torch.cuda.device_count()
    if word == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise ConfigError("--nproc-per-node xpu: no XPU device is available")
        return xpu.device_count()
    backend = torch._C._get_privateuse1_backend_name()
    module = getattr(torch, backend, None) if word == backend and backend != "privateuseone" else None
    if module is None:
        raise ConfigError(f"--nproc-per-node: expected a positive integer, {', '.join(DEVICE_WORDS)}, got {word!r}")
    if not module.is_available():
        raise ConfigError(f"--nproc-per-node {word}: no {word} device is available")
    return module.device_count()
