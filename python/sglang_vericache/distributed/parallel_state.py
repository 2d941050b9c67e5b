"""The tensor-parallel group of this process (SGLang's parallel_state, reduced to TP).

One scheduler process per rank. `init_tensor_parallel` joins the group (torch.distributed: gloo on
a CPU, NCCL on CUDA, plus a gloo group for host-side broadcasts); until then, and with --tp-size 1,
`get_tp_group()` is the one-rank group whose collectives are the identity.

Invariant (what makes every rank take the same decisions): every collective result is the same bits
on every rank. all_gather moves bits; `all_reduce` under deterministic inference all-gathers the
partial sums and adds them in rank order (p0 + p1 + ...), the same arithmetic on every rank and for
every batch size (a backend's own all-reduce may pick its algorithm, and so its summation order, by
message size); otherwise it is the backend's all_reduce (gloo's and NCCL's ring hand every rank the
same reduced chunks). Logits are all-gathered, so every rank samples from the same logits; the
sampled tokens are broadcast from rank 0 as well (rank 0 decides).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A collective failed: a peer rank exited or stopped answering within --dist-timeout."""


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    deterministic: bool = False  # all_reduce in rank order (see the module docstring); ModelRunner sets it
    device_group: object = None  # the model's collectives (gloo on a CPU, NCCL on CUDA)
    cpu_group: object = None  # host-side broadcasts (the scheduler's messages)
    stats: dict = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "broadcast": 0})

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of n (n divisible by size)."""
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, the same bits on every rank."""
        if self.size == 1:
            return x
        self.stats["all_reduce"] += 1
        if not self.deterministic:
            x = x.contiguous()
            _run(dist.all_reduce, x, group=self.device_group)
            return x
        parts = self._gather(x)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along dim, in rank order."""
        if self.size == 1:
            return x
        self.stats["all_gather"] += 1
        return torch.cat(self._gather(x), dim=dim)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _run(dist.all_gather, parts, x, group=self.device_group)
        return parts

    def broadcast(self, x: torch.Tensor, cpu: bool = False) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        if self.size == 1:
            return x
        self.stats["broadcast"] += 1
        _run(dist.broadcast, x, src=0, group=self.cpu_group if cpu else self.device_group)
        return x

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (others pass None): a length, then the payload, on the gloo group."""
        if self.size == 1:
            return data or b""
        n = torch.tensor([len(data) if self.is_first else 0], dtype=torch.int64)
        self.broadcast(n, cpu=True)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_first and n.item()
               else torch.empty(int(n.item()), dtype=torch.uint8))
        if n.item():
            self.broadcast(buf, cpu=True)
        return buf.numpy().tobytes()

    def min_over_ranks(self, value: int) -> int:
        """The smallest value of any rank, on every rank: for sizes measured from free memory (each
        rank's pools must have the same capacity, or their schedulers would decide differently)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        _run(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def agree(self, value: float) -> float:
        """Rank 0's value on every rank: for decisions that depend on measurements (iteration times)."""
        if self.size == 1:
            return value
        return float(self.broadcast(torch.tensor([value], dtype=torch.float64), cpu=True).item())


def _run(collective, *args, **kwargs) -> None:
    try:
        collective(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as e:  # gloo: "Connection closed by peer", timeouts
        raise TensorParallelError(f"a tensor-parallel collective failed ({collective.__name__}): {e}") from e


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def init_tensor_parallel(tp_size: int, tp_rank: int, init_addr: str | None, device: str, timeout_s: float,
                         deterministic: bool = False) -> TPGroup:
    """Joins the tp_size ranks at init_addr (host:port of rank 0's rendezvous): the device group
    (NCCL on CUDA, else gloo) and a gloo group for host-side broadcasts. -> the group (also get_tp_group())."""
    global _TP
    if tp_size == 1:
        _TP = TPGroup(deterministic=deterministic)
        return _TP
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(device.split(":")[1]) if ":" in device else tp_rank % torch.cuda.device_count())
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{init_addr}", world_size=tp_size,
                            rank=tp_rank, timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if cuda else device_group
    _TP = TPGroup(tp_rank, tp_size, deterministic, device_group, cpu_group)
    logger.info("tensor parallel: rank %d of %d (%s, rendezvous %s)", tp_rank, tp_size,
                "nccl" if cuda else "gloo", init_addr)
    return _TP


def set_tp_group(group: TPGroup) -> None:
    """For tests that build layers for a given rank without a process group."""
    global _TP
    _TP = group
