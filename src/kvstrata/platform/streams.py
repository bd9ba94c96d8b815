"""Copy streams and events of the compute device, behind one small interface.

On CUDA a decode step must never synchronise the host with the device: cold chunks
load on a copy stream while the compute stream attends the previous chunk, and the
two streams order themselves with events.

    host issues:  load c0, wait c0, load c1, attend c0, wait c1, load c2, attend c1, ...
    compute:      wait(ready c0)─[attend c0]──────────wait(ready c1)─[attend c1]── ...
    h2d:          [copy c0]─[copy c1]─wait(issued after attend c0)─[copy c2 → c0's buffer]

Each load waits for an event recorded on the compute stream when it is issued, each
attention for the event recorded after its load: c1 copies while c0 is attended, c2
reuses c0's buffer only once c0's attention is done.

`DeviceStreams` is that interface, duck-typed on torch's own classes so the CUDA
implementation adds nothing to the hot path:

    streams.h2d, streams.d2h      one copy stream per direction
    streams.compute()             the stream attention runs on (the caller's current)
    streams.event()               an event with timing: record(stream), query(),
                                  synchronize(), elapsed_time(end) in milliseconds
    stream.wait_event(event)      device-side wait, the host is not blocked
    streams.use(stream)           context: ops issued inside run on `stream`

`CudaStreams` is the real thing; the staging logic that drives it (which event guards
which staging buffer, stall accounting) is exercised on the CPU with a simulated
implementation in the tests (tests/platform/test_cuda_streams.py). On the CPU proper no
streams are used at all: `streams_for` returns None and the stager keeps its
thread-pool path.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """What the staging logic needs of an event (torch.cuda.Event has it)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class DeviceStreams(Protocol):
    """A compute device's copy streams and events (see the module docstring)."""

    h2d: Any
    d2h: Any

    def compute(self) -> Any: ...

    def event(self) -> DeviceEvent: ...

    def use(self, stream: Any) -> AbstractContextManager[Any]: ...


class CudaStreams:
    """`DeviceStreams` of one CUDA device: two side streams, timing events.

    Args:
        device: a CUDA device.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)

    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


def streams_for(device: torch.device) -> DeviceStreams | None:
    """The copy streams of `device`: CudaStreams on CUDA, None elsewhere (the CPU has
    no asynchronous copy engine; its transfers run on worker threads)."""
    if device.type == "cuda":
        return CudaStreams(device)
    return None


def copy_direction(dst: torch.Tensor, src: torch.Tensor) -> str:
    """ "h2d", "d2h" or "d2d" for a copy src -> dst (at least one side on a device)."""
    if dst.device.type != "cpu" and src.device.type == "cpu":
        return "h2d"
    if dst.device.type == "cpu":
        return "d2h"
    return "d2d"
