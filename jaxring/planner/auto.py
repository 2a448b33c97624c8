"""`train.py --plan auto`: the planner's best plan for the devices at hand, as train.py's settings.

    settings, result = auto_plan(model="gpt", preset="tiny", seq_len=256, batch_size=8, devices=jax.devices())
    TrainConfig(..., **settings)        # dp, pp, tp, sp, ep, attention, team_size, ..., zero, grad_accum

The cluster is read from the devices: their count, how many one process holds (a node), and their kind (H100
or H200 by name; anything else: the nominal "cpu" device, so the ranking still follows the bytes and FLOPs).
Settings the user gave (a mesh degree, --attention, --zero, ...) are held fixed in the search.
"""

from __future__ import annotations

from jaxring.planner.cluster import Cluster
from jaxring.planner.search import Result, search
from jaxring.planner.space import Candidate, Workload

# train.py / TrainConfig names of the Candidate fields
_FIELDS = {
    "dp": "dp",
    "pp": "pp",
    "tp": "tp",
    "sp": "sp",
    "ep": "ep",
    "attention": "attention",
    "layout": "layout",
    "team_size": "team_size",
    "ulysses_size": "ulysses_size",
    "placement": "placement",
    "tensor": "tensor_parallel",
    "zero": "zero",
    "pipeline": "pipeline",
    "microbatches": "microbatches",
    "virtual_stages": "virtual_stages",
    "remat": "remat",
}


def device_kind(devices) -> str:
    kind = str(getattr(devices[0], "device_kind", "")).lower()
    if getattr(devices[0], "platform", "") == "gpu":
        if "h200" in kind:
            return "h200"
        if "h100" in kind:
            return "h100"
        if "a100" in kind:
            return "a100-80gb" if "80" in kind else "a100-40gb"
    return "cpu"


def cluster_of(devices) -> Cluster:
    import jax

    per_node = max(1, len([d for d in devices if d.process_index == devices[0].process_index]))
    if getattr(devices[0], "platform", "") == "cpu":
        per_node = len(devices)  # simulated devices share one host
    del jax
    return Cluster.of(device_kind(devices), len(devices), devices_per_node=per_node)


def auto_plan(
    *,
    model: str,
    preset: str,
    seq_len: int | None,
    batch_size: int,
    devices,
    precision: str = "fp32",
    image_size: int | None = None,
    overrides: dict | None = None,
    fixed: dict | None = None,
) -> tuple[dict, Result]:
    """(TrainConfig settings of the best plan, the search result). fixed: TrainConfig names the user set."""
    w = Workload.of(
        model,
        preset,
        seq_len=(seq_len or 256) if model == "gpt" else None,
        image_size=image_size,
        global_batch=batch_size,
        precision=precision,
        **(overrides or {}),
    )
    back = {v: k for k, v in _FIELDS.items()}
    only = {back[k]: v for k, v in (fixed or {}).items() if k in back and v is not None}
    result = search(w, cluster_of(list(devices)), only=only)
    return settings_of(result.best.candidate, w), result


def settings_of(c: Candidate, w: Workload) -> dict:
    """TrainConfig fields of a candidate (grad_accum: the micro-steps when pp = 1)."""
    out = {name: getattr(c, field) for field, name in _FIELDS.items()}
    if c.pp == 1:
        out.update(pipeline="1f1b", microbatches=None, virtual_stages=1)
    if c.sp == 1:
        out["attention"] = None
    out["grad_accum"] = c.steps(w) if c.pp == 1 else 1
    return out


# train.py's argparse names of the settings (where they differ from TrainConfig's)
_ARGS = {"pipeline": "pipeline_schedule"}


def apply_auto_plan(args, devices, overrides: dict, log=print) -> Candidate:
    """train.py --plan auto: fills the mesh and strategy flags of train.py's parsed `args` with the planner's
    best plan for `devices` (flags the user gave are held fixed). Returns the chosen candidate."""
    fixed = {
        name: getattr(args, _ARGS.get(name, name))
        for name in (
            "dp",
            "pp",
            "tp",
            "sp",
            "ep",
            "attention",
            "layout",
            "team_size",
            "ulysses_size",
            "placement",
            "tensor_parallel",
            "zero",
            "microbatches",
        )
    }
    if getattr(args, "remat", "none") != "none":
        fixed["remat"] = args.remat  # --remat selective/full given: held; none (the default): searched
    settings, result = auto_plan(
        model=args.model,
        preset=args.preset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        devices=devices,
        precision=args.precision,
        image_size=args.image_size,
        overrides=overrides,
        fixed=fixed,
    )
    best = result.best
    for name, value in settings.items():
        setattr(args, _ARGS.get(name, name), value)
    w = result.workload
    log(
        f"--plan auto: {best.candidate.describe()} on {result.cluster.devices} × {result.cluster.device.name} "
        f"(predicted {best.step_s:.3g} s/step, {best.memory.total / 2**30:.2f} GiB per device; "
        f"{len(result.ranked)} of {result.considered} plans fit) for {w.describe()}"
    )
    return best.candidate
