"""Where a job computes: the device (`--device auto|cpu|cuda`), its dtype and its free memory.

- auto = CUDA when torch sees a GPU, else the CPU;
- dtype: bf16 on CUDA devices that support it, fp32 otherwise (on CPU bf16 matmuls are ~30x slower
  than fp32 on the machines this project is tested on);
- free memory: `torch.cuda.mem_get_info` on CUDA; on the CPU the smaller of the host's available
  memory (psutil) and what the job's memory cgroup still allows (a SLURM job's `--mem` is enforced by
  its cgroup, while psutil sees the whole node).
"""

from __future__ import annotations

from pathlib import Path

from mla.errors import UserError

CHOICES = ("auto", "cpu", "cuda")
_NO_LIMIT = 1 << 60  # cgroup v1 writes 2^63 - page size for "no limit"


def resolve_device(requested: str = "auto", *, flag: str = "--device", config_key: str | None = None):
    """torch.device for `requested` (auto | cpu | cuda | cuda:N); UserError when CUDA is asked for but absent."""
    import torch


    name = (requested or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            where = f" (set by {config_key}: gpu; use {config_key}: cpu on machines without one)" if config_key else ""
            raise UserError(f"{flag} {requested}: no CUDA GPU is visible to torch on this machine{where}")
        index = name.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise UserError(f"{flag} {requested}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device(name)
    raise UserError(f"{flag} {requested!r}: expected one of {', '.join(CHOICES)}")


def compute_dtype(device):
    """bf16 on CUDA devices that support it, else fp32 (CPU included)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def free_memory_bytes(device) -> int:
    """Bytes that can still be allocated on `device` (see the module docstring)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    available = int(psutil.virtual_memory().available)
    cgroup = cgroup_free_bytes()
    return available if cgroup is None else min(available, cgroup)


def cgroup_free_bytes(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> int | None:
    """limit - usage of this process's memory cgroup and its ancestors (the tightest), or None without a limit.

    cgroup v2 ("0::/path": memory.max, memory.current) and v1 ("N:memory:/path": memory.limit_in_bytes,
    memory.usage_in_bytes under root/memory).
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(root)
    candidates = []  # (base folder, cgroup path, limit file, usage file)
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append((root, path, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best = None
    for base, path, limit_name, usage_name in candidates:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor up to the mount root
            folder = base.joinpath(*parts[:depth])
            limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue
            free = max(0, limit - usage)
            best = free if best is None else min(best, free)
    return best


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    return int(text) if text.isdigit() else None


def describe(device, dtype) -> str:
    """'cuda:0 (NVIDIA H100, bf16)' / 'cpu (fp32)' for logs."""
    import torch

    kind = getattr(device, "type", str(device))
    short = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
    if kind == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {short})"
    return f"{device} ({short})"


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): timings must end when the work does."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"
