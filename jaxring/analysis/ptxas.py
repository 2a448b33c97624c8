"""The GPU kernels of a dumped XLA module: launch shapes from the thunk sequence, and for each kernel's PTX what
`ptxas -arch=sm_90a -v` says (registers, spill bytes, stack, wgmma serialized for lack of registers: C7511)."""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shutil
import subprocess

from jaxring.analysis.gpu_report import Kernel
from jaxring.analysis.gpu_target import SM_ARCH


def ptxas_path() -> str | None:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel (or PATH), or None."""
    try:
        import nvidia.cuda_nvcc

        for root in list(getattr(nvidia.cuda_nvcc, "__path__", [])):
            candidate = os.path.join(root, "bin", "ptxas")
            if os.access(candidate, os.X_OK):
                return candidate
    except ImportError:
        pass
    return shutil.which("ptxas")


_THUNK = re.compile(
    r"kCustomKernel.*?\]\s+(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+threads:\s*"
    r"\[(\d+),\s*(\d+),\s*(\d+)\]\s+shared_memory:\s*(\d+)"
)
_ENTRY = re.compile(r"\.visible\s+\.entry\s+([\w$.]+)\(")
_PTXAS_FN = re.compile(r"Function properties for ([\w$.]+)")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_NOTE_FN = re.compile(r"in (?:the )?function '([\w$.]+)'")


def read_kernels(dump_dir: str, ptxas: bool | str = True) -> list[Kernel]:
    """Kernels of the dumped module: launch shapes from `*thunk_sequence.txt`, resources from ptxas."""
    kernels: dict[str, Kernel] = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))):
        for m in _THUNK.finditer(pathlib.Path(path).read_text()):
            name = m.group(1)
            dims = [int(x) for x in m.groups()[1:8]]
            if name in kernels:
                kernels[name].launches += 1
            else:
                kernels[name] = Kernel(name, 1, tuple(dims[0:3]), tuple(dims[3:6]), dims[6])
    if ptxas:
        pattern = re.compile(ptxas) if isinstance(ptxas, str) else None
        exe = ptxas_path()
        if exe is None:
            raise RuntimeError("ptxas was not found (pip install nvidia-cuda-nvcc-cu12, or pass ptxas=False)")
        for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
            names = _ENTRY.findall(pathlib.Path(path).read_text())
            if pattern is not None and not any(pattern.search(n) for n in names):
                continue
            for name, info in run_ptxas(path, exe).items():
                k = kernels.setdefault(name, Kernel(name, 0, (0, 0, 0), (0, 0, 0), 0))
                for field, value in info.items():
                    setattr(k, field, value)
    return list(kernels.values())


def run_ptxas(ptx_path: str, exe: str | None = None) -> dict[str, dict]:
    """`ptxas -arch=sm_90a -v` on one PTX file: see `parse_ptxas`."""
    exe = exe or ptxas_path()
    out = subprocess.run(
        [exe, f"-arch={SM_ARCH}", "-v", ptx_path, "-o", os.devnull], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"ptxas failed on {ptx_path}: {(out.stdout + out.stderr)[-2000:]}")
    return parse_ptxas(out.stdout + out.stderr)


def parse_ptxas(text: str) -> dict[str, dict]:
    """ptxas -v output -> {entry: registers, spill_stores, spill_loads, stack_frame, wgmma_serialized,
    ptxas_notes (the lines naming the entry, e.g. C7511: wgmma serialized for lack of registers)}."""
    info: dict[str, dict] = {}
    notes: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := _NOTE_FN.search(line):
            notes.setdefault(m.group(1), []).append(line.split(":", 1)[-1].strip())
        if m := _PTXAS_FN.search(line):
            current = info.setdefault(m.group(1), {})
        elif current is not None and (m := _SPILLS.search(line)):
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            current["registers"] = int(m.group(1))
    for name, d in info.items():
        d["ptxas_notes"] = notes.get(name, [])
        d["wgmma_serialized"] = any("C7511" in n for n in d["ptxas_notes"])
    return info
