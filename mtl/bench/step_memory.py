"""A training step's peak memory on the CPU, as the step-cost tools measure it (``python -m mtl.tools.bench.ved_step``,
``.libmtl``, ``.architectures``): the bytes held when the step starts (parameters, the gradients a side keeps
between steps, the optimizer state: summed from the tensors) plus the highest running sum of the step's allocations
and frees (each op's own memory under ``torch.profiler``, in time order)."""

from __future__ import annotations

import torch


def held_bytes(modules, optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer state (each storage once)."""
    seen, total = set(), 0
    tensors = [t for m in modules for p in m.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def step_peak_bytes(step, batch, held) -> int:
    """``held()`` at the step's start plus the peak of the step's allocations net of frees (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    start = held()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(batch)
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.profiler.function_events)
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return start + peak
