"""What vLLM serves of a qvl adapter, and `qvl convert export-adapter ... --for vllm`: what serves it exactly.

vLLM's LoRA loader, read from its source (vllm/lora/, vllm/config/lora.py; not run here): a peft adapter's
language-model linears load as trained (q/k/v and gate/up as separate modules sharing one A are fine); vision-tower
and merger adapters are ignored unless `--enable-tower-connector-lora` (experimental), and the vision `attn.qkv` is
dropped even then; `use_dora` is refused; a rank above `--max-lora-rank` (default 16; one of MAX_LORA_RANKS) is
refused; Qwen3.5's Gated DeltaNet projections are dropped or have no effect depending on the version
(vllm-project/vllm#49354); 3-D expert adapters (`target_parameters`) load only where the model class declares them
and not reliably (vllm-project/vllm#40005, #41384).

So `--for vllm` writes, under OUT: `base/`, HF_BASE with every adapter vLLM would not serve as trained folded into
its weights (all of them for DoRA, or a rank vLLM cannot take), and `adapter/`, a peft adapter of the rest on that
base, with the `--max-lora-rank` it needs; `vllm.json` records the per-group view and the serve command. Both are
checked, loaded by transformers + peft, against the model the run trained (qvl.bridges.adapter_check).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qvl.bridges.adapter_check import DEFAULT_TOLERANCE, max_diff, peft_logits, trained_reference
from qvl.bridges.adapter_export import (
    ADAPTER_CONFIG,
    PeftState,
    base_model_name,
    build_adapted_model,
    find_adapter_run,
    hf_base_of,
    is_dora,
    peft_state,
    write_adapter,
    write_merged,
)

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks (vllm/config/lora.py)
DEFAULT_MAX_LORA_RANK = 16
VLLM_FILE = "vllm.json"
_TOWER = "ignored unless vllm serve --enable-tower-connector-lora (experimental)"


@dataclass(kw_only=True, slots=True, frozen=True)
class ModuleGroup:
    """Adapted transformers modules vLLM treats alike: a pattern over their live names, and vLLM's verdict."""

    name: str
    pattern: str  # a regex searched in the module's (or expert parameter's) live name
    served: bool  # whether vLLM applies the adapter as trained
    why: str


# First match wins: the vision qkv before the rest of the tower, the experts before the other MLPs.
GROUPS = (
    ModuleGroup(name="vision attention qkv", pattern=r"^model\.visual\..*\.attn\.qkv$", served=False,
                why="dropped by vLLM's loader, even with --enable-tower-connector-lora"),
    ModuleGroup(name="merger", pattern=r"^model\.visual\.(merger|deepstack_merger_list)\.", served=False, why=_TOWER),
    ModuleGroup(name="vision tower", pattern=r"^model\.visual\.", served=False, why=_TOWER),
    ModuleGroup(name="Gated DeltaNet", pattern=r"\.linear_attn\.", served=False,
                why="dropped or without effect, depending on the vLLM version (vllm-project/vllm#49354)"),
    ModuleGroup(name="MoE experts", pattern=r"\.experts\.(gate_up_proj|down_proj)$", served=False,
                why="3-D expert adapters (target_parameters) do not load reliably (vllm-project/vllm#40005, #41384)"),
    ModuleGroup(name="language attention", pattern=r"\.self_attn\.", served=True, why="served as trained"),
    ModuleGroup(name="language MLP", pattern=r"\.mlp\.", served=True, why="served as trained"),
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class GroupView:
    """One adapted module group as vLLM sees it."""

    group: str
    modules: int
    served: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_of(live_name: str) -> ModuleGroup:
    """The group of an adapted module or expert parameter (its live transformers name)."""
    return next((g for g in GROUPS if re.search(g.pattern, live_name)), GROUPS[-1])


def max_lora_rank(rank: int) -> int | None:
    """The smallest `--max-lora-rank` vLLM accepts for `rank`, or None above its largest."""
    return next((r for r in MAX_LORA_RANKS if r >= rank), None)


def unserved_reason(*, dora: bool, rank: int) -> str | None:
    """Why vLLM serves none of an adapter, whatever it adapts (DoRA, or a rank over its largest), else None."""
    if dora:
        return "vLLM refuses DoRA adapters (use_dora)"
    if max_lora_rank(rank) is None:
        return f"rank {rank} is over vLLM's largest --max-lora-rank {MAX_LORA_RANKS[-1]}"
    return None


def view(names: list[str], *, dora: bool, rank: int) -> list[GroupView]:
    """Per group of the adapted `names` (live module and expert parameter names), whether vLLM serves it."""
    whole = unserved_reason(dora=dora, rank=rank)
    counts: dict[ModuleGroup, int] = {}
    for name in names:
        counts[group_of(name)] = counts.get(group_of(name), 0) + 1
    return [
        GroupView(group=g.name, modules=counts[g], served=g.served and not whole, why=whole or g.why)
        for g in GROUPS
        if g in counts
    ]


def groups_of_config(config: dict[str, Any]) -> list[GroupView]:
    """vLLM's view of a written peft adapter (its adapter_config.json)."""
    names = list(config.get("target_modules") or []) + list(config.get("target_parameters") or [])
    return view(names, dora=bool(config.get("use_dora")), rank=int(config["r"]))


def served_part(state: PeftState, served: set[str]) -> PeftState:
    """The part of a peft state on the `served` modules (by live name)."""
    prefixes = tuple(f"base_model.model.{m}." for m in served)
    return PeftState(
        tensors={k: v for k, v in state.tensors.items() if k.startswith(prefixes)},
        modules=[m for m in state.modules if m in served],
        parameters=[],
        shared_a=[names for names in state.shared_a if names[0].startswith(prefixes)],
    )


@dataclass(kw_only=True, slots=True)
class VllmExport:
    """What `--for vllm` wrote and what its check measured against the trained model."""

    out: str
    groups: list[dict]
    rank: int
    max_lora_rank: int | None  # the --max-lora-rank vLLM needs; None where no adapter is left to serve
    base: str  # the checkpoint vLLM serves: OUT/base, or HF_BASE where nothing had to be folded in
    adapter: str | None  # OUT/adapter, or None where every adapter was folded into the base
    serve: str  # the vllm serve command line
    checked: bool
    adapter_effect: float | None = None
    max_abs_diff: float | None = None  # trained model vs transformers (+ peft) on what vLLM is given
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def ok(self) -> bool:
        close = self.max_abs_diff is None or self.max_abs_diff <= self.tolerance
        return close and not self.missing_keys and not self.unexpected_keys

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__} | {"ok": self.ok}


def serve_command(base: str, adapter: str | None, rank: int | None) -> str:
    """The `vllm serve` line for `base` with `adapter` (named `qvl`) at `--max-lora-rank rank`."""
    if adapter is None:
        return f"vllm serve {base}"
    return f"vllm serve {base} --enable-lora --lora-modules qvl={adapter} --max-lora-rank {rank}"


def export_vllm_on_rank(
    run_path: str, hf_base: str | None, out: str, check: bool, tolerance: float | None
) -> dict[str, Any]:
    """Write what vLLM serves exactly (OUT/base with the unserved adapters folded in, OUT/adapter with the rest) and
    check it against the trained model; the report as a dict (module level, so ranks import it)."""
    from qvl.bridges import verify

    run = find_adapter_run(Path(run_path))
    base = hf_base_of(run, hf_base)
    rank, dora = int(run.peft["dim"]), is_dora(run.peft)
    bridge, model, _ = build_adapted_model(run, base)
    state = peft_state(bridge, model, base)
    groups = view(state.modules + state.parameters, dora=dora, rank=rank)
    served = set() if unserved_reason(dora=dora, rank=rank) else {m for m in state.modules if group_of(m).served}
    unserved = {name for name, hf in state.sources.items() if not served.issuperset(hf)}
    served -= {hf for name in unserved for hf in state.sources[name]}  # a module is folded whole or served whole
    out_dir = Path(out)
    base_dir = (out_dir / "base").resolve() if unserved else base
    adapter_dir = out_dir / "adapter" if served else None
    if adapter_dir:
        on = str(base_dir) if unserved else None  # None: HF_BASE's own name (qvl.bridges.adapter_export)
        write_adapter(run, bridge, model, base, adapter_dir, state=served_part(state, served), base=on)
    if unserved:
        write_merged(bridge, model, base, base_dir, fold=lambda name: name in unserved)
    del model, bridge
    needed = max_lora_rank(rank) if served else None
    served_base = str(base_dir) if unserved else base_model_name(base)
    adapter_path = str(adapter_dir.resolve()) if adapter_dir else None
    report = VllmExport(
        out=out, groups=[g.as_dict() for g in groups], rank=rank, max_lora_rank=needed, base=served_base,
        adapter=adapter_path, serve=serve_command(served_base, adapter_path, needed),
        checked=check, tolerance=tolerance or DEFAULT_TOLERANCE,
    )  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / VLLM_FILE).write_text(json.dumps({k: v for k, v in report.as_dict().items() if k != "ok"}, indent=2))
    if check:
        inputs = verify.config_inputs(base)
        ours, report.adapter_effect = trained_reference(run, inputs)
        if adapter_dir:
            reference, report.missing_keys, report.unexpected_keys = peft_logits(base_dir, adapter_dir, inputs)
        else:
            reference = verify.hf_logits(base_dir, inputs)
        report.max_abs_diff = max_diff(ours, reference)
    return report.as_dict()


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """A written adapter's adapter_config.json."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
