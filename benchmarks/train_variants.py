"""The training runs one `bench_train` invocation compares, the ratios it reports between them, and its goals.

A variant is a pack length, a mode (packed, or the same samples one per micro-batch padded to the longest) and what
differs from the run `qvl train` would make on this device: recipe options (`compile=true`) and patch groups left
off (`-speed-cuda-graphs`). On the command line: `SEQ:MODE[:KEY=VALUE][:-GROUP][:steps=N]`, e.g.
`4096:packed:compile=true:steps=5`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qvl.foundation import patches

MODES = ("packed", "padded")
# What gpu.sh's train stage runs at real shapes (issue 38's figures), most wanted first (a run the stage's time limit
# cuts off loses only itself): packed and padded at 4k on the same samples, the layers eager (CUDA graphs off) for
# the graphs' own effect, `compile` on, packed at 8k, and last packed 4k with every vision block recomputed (what
# the census estimates recompute costs: benchmarks/RESULTS.md). Steps per run are chosen so that they fit one
# device call (benchmarks/gpu.sh: `rehearse` checks the stage limits).
REAL_SHAPES = (
    "4096:packed",
    "4096:padded:steps=3",
    "4096:packed:-speed-cuda-graphs:steps=4",
    "4096:packed:compile=true:steps=4",
    "8192:packed:steps=3",
    "4096:packed:vision_recompute=true:steps=3",
)
TINY = ("256:packed", "256:padded")
# The GPU-path targets on one H100, bf16, no TE (issue 38: MFU >= 0.35 by Megatron-Bridge's formula, 0.45 the aim;
# GPU idle under 10% of the step; packed >= 1.5x padded tokens/s on the same samples).
GOALS = {"mfu": 0.35, "gpu_idle": 0.10, "packed_over_padded": 1.5, "data_wait": 0.02, "plan_error": 0.15}


@dataclass(kw_only=True, slots=True, frozen=True)
class Variant:
    """One training run of the benchmark."""

    seq_length: int
    mode: str = "packed"
    options: tuple[tuple[str, Any], ...] = ()  # recipe options on top of the benchmark's
    groups_off: tuple[str, ...] = ()  # patch groups the switch would apply, left off
    steps: int | None = None  # None: the benchmark's --steps

    @property
    def base(self) -> bool:
        """Whether this is the run `qvl train` makes (nothing changed but the mode)."""
        return not self.options and not self.groups_off

    @property
    def name(self) -> str:
        """`4096-packed`, `4096-packed-compile=True`, `4096-packed-no-speed-cuda-graphs`."""
        parts = [str(self.seq_length), self.mode, *(f"{k}={v}" for k, v in self.options)]
        return "-".join(parts + [f"no-{group}" for group in self.groups_off])


def parse(text: str) -> Variant:
    """A variant from its command-line spelling (`SEQ:MODE[:KEY=VALUE][:-GROUP][:steps=N]`)."""
    from qvl.recipes.overrides import parse_value, split_pair

    seq, _, rest = text.partition(":")
    fields = [f for f in rest.split(":") if f]
    mode = fields.pop(0) if fields and fields[0] in MODES else "packed"
    options, off, steps = [], [], None
    for field in fields:
        if field.startswith("-"):
            off.append(field[1:])
        elif field.startswith("steps="):
            steps = int(field.removeprefix("steps="))
        elif "=" in field:
            key, value = split_pair(field)
            options.append((key, parse_value(value)))
        else:
            raise ValueError(f"variant {text!r}: {field!r} is none of packed, padded, KEY=VALUE, -GROUP, steps=N")
    if not seq.isdigit():
        raise ValueError(f"variant {text!r} does not start with a pack length (e.g. 4096:packed)")
    unknown = [group for group in off if group not in patches.GROUPS]
    if unknown:
        raise ValueError(f"variant {text!r}: no patch group {', '.join(unknown)}; groups: {', '.join(patches.GROUPS)}")
    return Variant(seq_length=int(seq), mode=mode, options=tuple(options), groups_off=tuple(off), steps=steps)


def comparisons(rows: list[dict]) -> list[dict]:
    """tokens/s ratios between runs that differ in one thing: packed / padded at one length, `compile` on / off, and
    each group left off against the run with it (every one against the base packed run at its length). Where the two
    train the same batches (an option or a group, not the padding), also the largest relative difference of their
    losses over the steps both ran: a group that changed the numbers shows there (bf16 rounding alone is ~1e-3)."""
    measured = [r for r in rows if "tokens_per_s_per_gpu" in r["result"]]
    base = {r["seq_length"]: r for r in measured if r["base"] and r["mode"] == "packed"}
    out = []
    for row in measured:
        reference = base.get(row["seq_length"])
        if reference is None or row is reference:
            continue
        if row["base"]:  # padded against packed
            what, ratio = (
                "packed / padded",
                reference["result"]["tokens_per_s_per_gpu"] / row["result"]["tokens_per_s_per_gpu"],
            )
        elif row["options"]:
            what = "with " + ", ".join(f"{k}={v}" for k, v in row["options"].items()) + " / without"
            ratio = row["result"]["tokens_per_s_per_gpu"] / reference["result"]["tokens_per_s_per_gpu"]
        else:
            what = "with " + ", ".join(row["groups_off"]) + " / without"
            ratio = reference["result"]["tokens_per_s_per_gpu"] / row["result"]["tokens_per_s_per_gpu"]
        comparison = {"figure": f"tokens/s at {row['seq_length']}: {what}", "runs": [reference["name"], row["name"]],
                      "value": round(ratio, 3)}  # fmt: skip
        if not row["base"]:
            comparison["loss_max_relative_difference"] = loss_difference(reference["result"], row["result"])
        out.append(comparison)
    return out


def loss_difference(first: dict, second: dict) -> float | None:
    """The largest |a - b| / |a| over the steps whose losses both runs logged (None: no step in common)."""
    pairs = [
        (a, b) for a, b in zip(first.get("losses", []), second.get("losses", [])) if a is not None and b is not None
    ]
    return round(max(abs(a - b) / abs(a) for a, b in pairs), 6) if pairs else None


def summarize(results: dict) -> None:
    """`runs` (the base packed and padded run of each length, as `qvl train` makes them, and their tokens/s ratio),
    `comparisons` between runs that differ in one thing, and `patch_groups` of the first base packed run."""
    results["runs"] = []
    for seq_length in sorted({v["seq_length"] for v in results["variants"]}):
        row: dict = {"seq_length": seq_length}
        for v in results["variants"]:
            if v["seq_length"] == seq_length and v["base"]:
                row[v["mode"]] = v["result"]
        if all("tokens_per_s_per_gpu" in row.get(mode, {}) for mode in MODES):
            ratio = row["packed"]["tokens_per_s_per_gpu"] / row["padded"]["tokens_per_s_per_gpu"]
            row["packed_over_padded_tokens_per_s"] = round(ratio, 3)
        results["runs"].append(row)
    results["comparisons"] = comparisons(results["variants"])
    base = [v["result"] for v in results["variants"] if v["base"] and v["mode"] == "packed"]
    results["patch_groups"] = next((r["patch_groups"] for r in base if "patch_groups" in r), None)


def checks(results: dict) -> list[dict]:
    """The goals: workers out-deliver one process; on a GPU, the loader keeps up and the step never waits on data."""
    out = []
    for row in results["loader"]:
        one, many = row["workers_0"], max(v for k, v in row.items() if k.startswith("workers_") and k != "workers_0")
        out.append(
            {
                "figure": f"loader packs/s at {row['seq_length']}: workers / one process",
                "value": round(many / one, 2),
                "goal": "> 1",
                "met": many > one,
            }  # fmt: skip
        )
        if row.get("consumed") and results["gpu_kind"]:
            out.append(
                {"figure": f"loader packs/s at {row['seq_length']} with workers / packs/s the GPU step consumed",
                 "value": round(many / row["consumed"], 2), "goal": ">= 1", "met": many >= row["consumed"]}
            )  # fmt: skip
        if "h100_step_needs_planned" in row:
            needed = row["h100_step_needs_planned"]
            out.append(
                {"figure": f"loader packs/s at {row['seq_length']} with workers / planned H100 need",
                 "value": round(many / needed, 2), "goal": ">= 1 (else: more workers)", "met": many >= needed}
            )  # fmt: skip
    if results["gpu_kind"]:
        for run in results["runs"]:
            packed = run.get("packed", {"error": "not run"})
            if "error" in packed:
                out.append({"figure": f"packed run at {run['seq_length']}", "value": packed["error"][:200],
                            "goal": "runs", "met": False})  # fmt: skip
                continue
            n = run["seq_length"]
            out.append(
                {
                    "figure": f"data-wait fraction at {n}",
                    "value": packed["data_wait_fraction"],
                    "goal": f"< {GOALS['data_wait']}",
                    "met": packed["data_wait_fraction"] < GOALS["data_wait"],
                }
            )
            out.append(
                {
                    "figure": f"MFU (Megatron-Bridge formula), packed at {n}",
                    "value": packed["mfu_megatron_bridge"],
                    "goal": f">= {GOALS['mfu']}",
                    "met": (packed["mfu_megatron_bridge"] or 0) >= GOALS["mfu"],
                }
            )
            if "packed_over_padded_tokens_per_s" in run:
                ratio = run["packed_over_padded_tokens_per_s"]
                out.append(
                    {
                        "figure": f"packed / padded tokens/s at {n}",
                        "value": ratio,
                        "goal": f">= {GOALS['packed_over_padded']}",
                        "met": ratio >= GOALS["packed_over_padded"],
                    }
                )
            idle = (packed.get("profile", {}).get("share_of_step") or {}).get("idle")
            if idle is not None:
                out.append({"figure": f"GPU idle share of the step, packed at {n}", "value": idle,
                            "goal": f"< {GOALS['gpu_idle']}", "met": idle < GOALS["gpu_idle"]})  # fmt: skip
            if (packed.get("plan") or {}).get("total_gib") and packed.get("peak_memory_gib"):  # not a failed plan
                error = packed["plan"]["total_gib"] / packed["peak_memory_gib"] - 1
                out.append(
                    {
                        "figure": f"qvl plan peak memory / measured - 1 at {n}",
                        "value": round(error, 3),
                        "goal": f"within +-{GOALS['plan_error']}",
                        "met": abs(error) <= GOALS["plan_error"],
                    }
                )
    return out
