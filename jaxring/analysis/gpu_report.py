"""What a GPU compile reports: its kernels (launch shape, ptxas' resources), its memory, its communication
loops (async collectives and the compute they span), its cost (`jaxring.analysis.gpu.compile_for_gpu` fills it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Kernel:
    """One GPU kernel: launch shape from the thunk sequence, resources from ptxas."""

    name: str
    launches: int
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int  # bytes per block
    registers: int | None = None  # per thread (None: ptxas not run)
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    stack_frame: int | None = None
    wgmma_serialized: bool | None = None  # ptxas C7511
    ptxas_notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def spills(self) -> int | None:
        return None if self.spill_stores is None else self.spill_stores + self.spill_loads


@dataclasses.dataclass
class AsyncCollective:
    """One async collective in a loop body and what the schedule puts between its start and its done."""

    name: str
    kind: str
    shape: str
    spans: list[str]  # compute ops (kernels) scheduled between start and done
    carried: bool = False  # started in an earlier iteration (or before the loop)

    @property
    def spans_compute(self) -> bool:
        return self.carried or bool(self.spans)


@dataclasses.dataclass
class CommLoop:
    """A `while` loop whose body holds collectives (a ring)."""

    body: str
    trip_count: int | None
    compute: list[str]  # compute ops of the body, in schedule order
    collectives: list[AsyncCollective]
    sync_collectives: list[str]  # collectives issued synchronously (no start/done pair)

    @property
    def overlapped(self) -> bool:
        """Every collective is async and spans compute (trivially true for a loop without compute)."""
        return not self.sync_collectives and all(c.spans_compute for c in self.collectives)


@dataclasses.dataclass
class GpuCompileReport:
    target: str
    num_devices: int
    kernels: list[Kernel]
    memory: dict[str, int]
    loops: list[CommLoop]
    cost: dict[str, float]
    hlo: str = dataclasses.field(repr=False)
    compile_seconds: float = 0.0
    entry: CommLoop | None = None  # collectives outside loops, with the same overlap analysis

    def kernel(self, name: str) -> Kernel:
        """The kernel called `name` (exactly, or as the only kernel whose name starts with it)."""
        hits = [k for k in self.kernels if k.name == name] or [k for k in self.kernels if k.name.startswith(name)]
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} kernels match {name!r}: {[k.name for k in self.kernels][:40]}")
        return hits[0]

    def custom_kernels(self, prefix: str = "jaxring_") -> list[Kernel]:
        return [k for k in self.kernels if k.name.startswith(prefix)]

    @property
    def peak_bytes(self) -> int:
        m = self.memory
        return m["argument"] + m["output"] + m["temp"] - m["alias"]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("hlo")
        pairs = list(zip(d["loops"], self.loops)) + ([(d["entry"], self.entry)] if self.entry else [])
        for loop, src in pairs:
            loop["overlapped"] = src.overlapped
            for c, c_src in zip(loop["collectives"], src.collectives):
                c["spans_compute"] = c_src.spans_compute
        d["peak_bytes"] = self.peak_bytes
        return d

    def summary(self, kernel_prefix: str = "jaxring_") -> str:
        lines = [
            f"{self.target} x {self.num_devices}: compiled in {self.compile_seconds:.1f} s; per device "
            f"args {self.memory['argument'] / 2**20:.1f} MiB, temp {self.memory['temp'] / 2**20:.1f} MiB, "
            f"out {self.memory['output'] / 2**20:.1f} MiB"
        ]
        for k in self.custom_kernels(kernel_prefix) or self.kernels:
            lines.append(
                f"  kernel {k.name}: grid {list(k.grid)}, threads {k.threads[0]}, smem {k.shared_memory} B,"
                f" regs {k.registers}, spills {k.spill_stores}/{k.spill_loads} B, "
                f"wgmma serialized {k.wgmma_serialized}"
            )
        for loop in self.loops + ([self.entry] if self.entry else []):
            what = "outside loops" if loop is self.entry else f"loop {loop.body} (x{loop.trip_count})"
            lines.append(f"  {what}: {len(loop.compute)} compute ops, overlapped {loop.overlapped}")
            for c in loop.collectives:
                what = "carried across iterations" if c.carried else f"spans {len(c.spans)} compute ops"
                lines.append(f"    {c.kind} {c.name} {c.shape}: {what}")
            for name in loop.sync_collectives:
                lines.append(f"    synchronous {name}")
        return "\n".join(lines)
