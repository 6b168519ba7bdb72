"""`qvl doctor --patches`: every upstream change qvl makes (qvl.foundation.patches), by group, with the switch's
answer for a recipe and device (qvl.kernels.switch); `--markdown` writes docs/upstream.md.

    qvl doctor --patches                                   # this machine, any model
    qvl doctor --patches --recipe qwen2_5_vl_3b_sft --device cuda --json
    qvl doctor --patches --markdown > docs/upstream.md     # the committed table (tests/launchers/test_upstream_report.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from typing import Any

from qvl.foundation import forks, patch_entries, patches
from qvl.kernels import switch

MARKDOWN_COMMAND = "qvl doctor --patches --markdown > docs/upstream.md"


def target_for(recipe: str | None, device: str | None) -> switch.Target:
    """The switch's target for `recipe` (its config: the model's parts; None: any model) on `device`."""
    config = None
    if recipe is not None:
        from qvl.recipes.registry import get_recipe

        # Building the config may log (a handler another caller put on stdout, e.g. Rich's); stdout is the report's.
        with contextlib.redirect_stdout(sys.stderr):
            config = get_recipe(recipe).fn()  # imports Megatron-Bridge
    return switch.Target.of(config, device=device)


def _forks_by_upstream() -> dict[str, patch_entries.Fork]:
    return {fork.upstream: fork for fork in forks.FORKS}


def report(target: switch.Target) -> dict[str, Any]:
    """The registry for `target`: each group with the switch's decision and its entries, then the stand-ins,
    private reads and forks (JSON-ready)."""
    by_upstream = _forks_by_upstream()
    groups = []
    for decision in switch.decide(target):
        entries = [
            {
                "target": p.target,
                "replacement": p.replacement,
                "why": p.why,
                "version": p.version,
                "fork": by_upstream[p.target].copied_in if p.target in by_upstream else None,
            }
            for p in patches.PATCHES
            if p.group == decision.group
        ]
        groups.append({**asdict(decision), "kind_meaning": patch_entries.KINDS[decision.kind], "entries": entries})
    return {
        "target": asdict(target),
        "groups": groups,
        "stand_ins": [{**asdict(s), "kind": s.kind} for s in patches.STAND_INS],
        "kept_out": [{**asdict(k), "kind": k.kind} for k in patches.KEPT_OUT],
        "private_reads": [asdict(r) for r in patches.PRIVATE_READS],
        "forks": [asdict(f) for f in forks.FORKS],
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def markdown() -> str:
    """The registry as docs/upstream.md: the same for every machine (conditions, not this machine's answers)."""
    by_group = report(switch.Target.of(device="cpu"))["groups"]
    lines = [
        "# Upstream changes",
        "",
        f"<!-- Generated from foundation/patches.py by `{MARKDOWN_COMMAND}`; do not edit by hand. -->",
        "",
        "Every change qvl makes to code it does not own is one entry of `foundation/patches.py`, applied and undone by",
        "group. A group's name starts with its kind; `qvl.kernels.switch` decides which groups a run uses, from the",
        "run's config and the device it runs on: `qvl doctor --patches --recipe NAME --device cuda` prints its answer.",
        "Versions are the pins of `launchers/requirements-stack.txt` and `requirements-nodeps.txt`.",
        "",
        "## Kinds",
        "",
        *_table(("kind", "meaning"), list(patch_entries.KINDS.items())),
        "",
        "## Groups",
        "",
        *_table(
            ("group", "kind", "applied", "on when", "entries"),
            [(f"`{g['group']}`", g["kind"], g["scope"], g["condition"], len(g["entries"])) for g in by_group],
        ),
    ]
    for group in by_group:
        lines += ["", f"### `{group['group']}`", ""]
        lines += _table(
            ("upstream target", "replaced by", "why", "written against"),
            [
                (
                    f"`{e['target']}`",
                    f"`{e['replacement']}`",
                    e["why"] + (" (a fork)" if e["fork"] else ""),
                    e["version"],
                )
                for e in group["entries"]
            ],
        )
    lines += ["", "## Forks", "", "Upstream bodies qvl copies and changes; a test pins each source's hash.", ""]
    lines += _table(
        ("upstream", "qvl's copy", "source sha256", "written against"),
        [(f"`{f.upstream}`", f"`{f.copied_in}`", f"`{f.source_sha256}`", f.version) for f in forks.FORKS],
    )
    lines += ["", "## Stand-ins", "", "Optional packages an upstream module imports unconditionally.", ""]
    lines += _table(
        ("module", "package", "what to do", "written against"),
        [(f"`{s.module}`", f"`{s.submodule}`", s.advice, s.version) for s in patches.STAND_INS],
    )
    lines += ["", "## Kept out of the import", "", "Installed packages an upstream plugin loader would import "
              "with Megatron-Bridge, kept out of that one import.", ""]  # fmt: skip
    lines += _table(
        ("package", "plugin loader", "why", "written against"),
        [(f"`{k.package}`", f"`{k.plugin_loader}`", k.why, k.version) for k in patches.KEPT_OUT],
    )
    lines += ["", "## Private reads", "", "Private upstream names qvl reads without replacing them.", ""]
    lines += _table(
        ("name", "used in", "why", "written against"),
        [(f"`{r.target}.{r.attribute}`", f"`{r.used_in}`", r.why, r.version) for r in patches.PRIVATE_READS],
    )
    return "\n".join(lines) + "\n"


def _state(on: bool | None) -> str:
    return {True: "[green]on[/]", False: "off", None: "[yellow]with the model[/]"}[on]


def print_table(content: dict[str, Any], title: str) -> None:
    """The groups as one table and each group's entries under it (rich)."""
    from rich.console import Console  # `qvl` imports every command module to build its parser
    from rich.table import Table

    console = Console(width=160)
    table = Table(title=title)
    for column in ("group", "kind", "applied", "on", "on when", "entries"):
        table.add_column(column, overflow="fold")
    for g in content["groups"]:
        table.add_row(g["group"], g["kind"], g["scope"], _state(g["on"]), g["condition"], str(len(g["entries"])))
    console.print(table)
    for g in content["groups"]:
        entries = Table(title=f"{g['group']} ({g['kind']}: {g['kind_meaning']})", show_lines=False)
        for column in ("upstream target", "why", "written against"):
            entries.add_column(column, overflow="fold")
        for e in g["entries"]:
            fork = f" [dim](fork: {e['fork']})[/]" if e["fork"] else ""
            entries.add_row(e["target"], e["why"] + fork, e["version"])
        console.print(entries)


def run_patches(args: argparse.Namespace) -> int:
    """`qvl doctor --patches`: the registry, with the switch's answer for `--recipe` on `--device`."""
    if args.markdown:
        print(markdown(), end="")
        return 0
    target = target_for(args.recipe, args.device)
    content = report(target)
    if args.json:
        print(json.dumps(content, indent=1))
        return 0
    model = args.recipe or "any model (pass --recipe NAME for its answer)"
    print_table(content, f"qvl's upstream changes for {model} on {target.device}")
    return 0
