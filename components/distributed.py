"""One stage, several processes: under `accelerate launch` or `torchrun` (WORLD_SIZE > 1) every process runs the
stage and trains its share of each batch; the main process alone writes models, checkpoints, metrics and reports,
and the others wait for it. For one process all of this does nothing, so a stage reads the same either way.

The effective batch is the params' `batch_size × gradient_accumulation_steps` whatever the process count: each of N
processes accumulates `gradient_accumulation_steps / N` batches, so the learning rate needs no change and N
processes train what one would, within floating-point tolerance.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_alone = False  # inside `alone()`: this process acts as the only one


def world_size() -> int:
    return 1 if _alone else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return 0 if _alone else int(os.environ.get("RANK", "0"))


@contextmanager
def alone() -> Iterator[None]:
    """Within the block this process acts as the only one, every collective a no-op: for work one process does by
    itself while the others wait elsewhere (the main process's learning-curve games, a step only it runs), where a
    collective would wait for processes that never come."""
    global _alone
    was, _alone = _alone, True
    try:
        yield
    finally:
        _alone = was


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> str:
    """This process's device: its own GPU under a launcher (the LOCAL_RANK-th), else the CPU."""
    import torch

    return f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"


# How long a process waits in a collective for the others: the main process does some work alone (a step that is not
# rank-aware inside correction_rounds, a learning-curve point, the replay audit) while the others wait at a barrier,
# longer than the trainers' default of 30 minutes (NCCL's watchdog: 10) on a large run.
PROCESS_GROUP_TIMEOUT_S = 6 * 3600


def join() -> None:
    """Join the launch's process group now (the CLI does, before a stage), so that it is made with our timeout: the
    first to make it (a Trainer would, with its own) sets it for every collective after."""
    if world_size() > 1:
        _state()


def _state():
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    # the same process group the trainers join (transformers' use_cpu: gloo on a CPU, nccl on GPUs)
    return PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))


def is_main_process() -> bool:
    return world_size() == 1 or _state().is_main_process


def wait_for_everyone() -> None:
    if world_size() > 1:
        _state().wait_for_everyone()


@contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (a conversion into a cache, a cleanup), then the others."""
    if world_size() == 1:
        yield
        return
    with _state().main_process_first():
        yield


def share(items: int) -> range:
    """This process's contiguous share of `items` things done once each (the first processes take one more)."""
    processes, me = world_size(), rank()
    size, extra = divmod(items, processes)
    start = me * size + min(me, extra)
    return range(start, start + size + (me < extra))


def on_one_machine() -> bool:
    """Whether every process runs on this machine (LOCAL_WORLD_SIZE, set by torchrun and accelerate, is the world)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) == world_size()


def per_process_accumulation(gradient_accumulation_steps: int) -> int:
    """The gradient accumulation steps of one process that keep the effective batch of the params."""
    processes = world_size()
    if gradient_accumulation_steps % processes:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} does not divide among "
                         f"{processes} processes: the effective batch (batch_size x gradient_accumulation_steps) is "
                         f"kept whatever the process count, so set it to a multiple of {processes}")
    return gradient_accumulation_steps // processes


def broadcast(value: Any) -> Any:
    """The main process's `value`, in every process (the others' `value` is ignored)."""
    if world_size() == 1:
        return value
    import torch.distributed as dist

    _state()  # joins the process group
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value: Any) -> list[Any]:
    """Every process's `value`, in rank order."""
    if world_size() == 1:
        return [value]
    import torch.distributed as dist

    _state()
    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def sum_gradients(parameters: list[Any]) -> None:
    """Each parameter's gradient summed over the processes, where each holds the gradient of its share of a sum (a
    loss over micro-batches): every process then holds the gradient one process would have. A parameter no process
    has a gradient for keeps none, as in one process (the optimizer skips it)."""
    if world_size() == 1:
        return
    import torch
    import torch.distributed as dist

    _state()
    has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32,
                            device=parameters[0].device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    for parameter, anywhere in zip(parameters, has_grad.tolist(), strict=True):
        if anywhere:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad)


def sum_numbers(numbers: dict[str, float]) -> dict[str, float]:
    """Each number summed over the processes."""
    return {key: sum(part[key] for part in all_gather(numbers)) for key in numbers}
