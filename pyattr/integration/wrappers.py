"""Parallel wrappers around a model: relevance runs on the module they wrap.

``nn.DataParallel`` and ``DistributedDataParallel`` exist to split a training step's
batch and all-reduce parameter gradients. Relevance needs neither: the parameters are
frozen for the pass, and each process explains its own prompts (``pyattr run`` under
torchrun splits the prompts, not the batch). So every public entry point explains
``wrapper.module``, on the device it lives on, with results identical to the unwrapped
model. FSDP shards the parameters themselves, so its inner module cannot run alone: it
is refused with a pointer to ``device_map``.
"""

from __future__ import annotations

from torch import nn


def _fsdp_types() -> tuple:
    types = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        types.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        types.append(FSDPModule)
    except ImportError:  # pragma: no cover - torch < 2.6
        pass
    return tuple(types)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``nn.DataParallel`` / ``DistributedDataParallel`` wrappers (any depth).

    Raises:
        TypeError: ``model`` is sharded with FSDP (``FullyShardedDataParallel`` or
            ``fully_shard``): no process holds whole parameters to explain with.
    """
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        model = model.module
    if not isinstance(model, nn.Module):
        return model  # the caller's own check names the argument
    fsdp = _fsdp_types()
    if fsdp and any(isinstance(m, fsdp) for m in model.modules()):
        raise TypeError(
            f"model is sharded with FSDP ({type(model).__name__}): relevance needs whole "
            "parameters in one process. Load the model unsharded, and for a model bigger than "
            "one device use device_map= (accelerate) instead"
        )
    return model
