"""Move byte strings over a :class:`Comm` as uint8 tensors: lengths first, then payloads.

The building block of the object collectives and of window set-up; no pickle
anywhere (the bytes are whatever the caller encoded, e.g. with the msgspec codec).
"""

from __future__ import annotations

import datetime

import torch

from .ops import CommOps


def _as_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _lengths(comm: CommOps, n: int, timeout: float | datetime.timedelta | None) -> list[int]:
    out = torch.empty(comm.get_size(), dtype=torch.int64)
    comm.all_gather_single(out, torch.tensor([n], dtype=torch.int64), timeout=timeout)
    return [int(x) for x in out.tolist()]


def all_gather_bytes(
    comm: CommOps, data: bytes, timeout: float | datetime.timedelta | None = None
) -> list[bytes]:
    sizes = _lengths(comm, len(data), timeout)
    outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    comm.all_gather_v(outs, _as_tensor(data), timeout=timeout)
    return [t.numpy().tobytes() for t in outs]


def broadcast_bytes(
    comm: CommOps, data: bytes | None, root: int, timeout: float | datetime.timedelta | None
) -> bytes:
    mine = comm.get_rank() == root
    length = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64)
    comm.broadcast(length, root, timeout=timeout)
    n = int(length.item())
    if mine:
        assert data is not None
        payload = _as_tensor(data)
    else:
        payload = torch.empty(n, dtype=torch.uint8)
    if n:
        comm.broadcast(payload, root, timeout=timeout)
    return data if mine and data is not None else payload.numpy().tobytes()


def send_bytes(
    comm: CommOps, data: bytes, dst: int, timeout: float | datetime.timedelta | None
) -> None:
    comm.send(torch.tensor([len(data)], dtype=torch.int64), dst, timeout=timeout)
    if data:
        comm.send(_as_tensor(data), dst, timeout=timeout)


def recv_bytes(comm: CommOps, src: int, timeout: float | datetime.timedelta | None) -> bytes:
    length = torch.empty(1, dtype=torch.int64)
    comm.recv(length, src, timeout=timeout)
    n = int(length.item())
    if not n:
        return b""
    payload = torch.empty(n, dtype=torch.uint8)
    comm.recv(payload, src, timeout=timeout)
    return payload.numpy().tobytes()


def gather_bytes(
    comm: CommOps, data: bytes, root: int, timeout: float | datetime.timedelta | None
) -> list[bytes] | None:
    """Rank ``root`` returns every rank's bytes in rank order; others return None.

    Sizes are all-gathered (every rank knows them), then the payloads travel
    padded to the longest, since Gloo's gather needs equal shapes.
    """
    sizes = _lengths(comm, len(data), timeout)
    longest = max(sizes)
    if longest == 0:
        return [b""] * comm.get_size() if comm.get_rank() == root else None
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = _as_tensor(data)
    outs = None
    if comm.get_rank() == root:
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    comm.gather(outs, padded, root, timeout=timeout)
    if outs is None:
        return None
    return [t[:n].numpy().tobytes() for t, n in zip(outs, sizes)]


def scatter_bytes(
    comm: CommOps, items: list[bytes] | None, root: int, timeout: float | datetime.timedelta | None
) -> bytes:
    """Rank ``i`` receives ``items[i]`` from ``root``."""
    size = comm.get_size()
    mine = comm.get_rank() == root
    lengths = torch.zeros(size, dtype=torch.int64)
    if mine:
        assert items is not None
        lengths = torch.tensor([len(b) for b in items], dtype=torch.int64)
    comm.broadcast(lengths, root, timeout=timeout)
    sizes = [int(x) for x in lengths.tolist()]
    longest = max(sizes)
    if longest == 0:
        return b""
    out = torch.empty(longest, dtype=torch.uint8)
    inputs = None
    if mine:
        assert items is not None
        inputs = [torch.zeros(longest, dtype=torch.uint8) for _ in items]
        for tensor, item in zip(inputs, items):
            tensor[: len(item)] = _as_tensor(item)
    comm.scatter(out, inputs, root, timeout=timeout)
    return out[: sizes[comm.get_rank()]].numpy().tobytes()
