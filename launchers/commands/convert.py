"""`qvl convert import | export | verify | export-adapter`: HF <-> Megatron checkpoints (any TP/PP layout) and PEFT
adapters, with proof."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from qvl.foundation.errors import ConversionError
from qvl.launchers.os_errors import os_errors_as

# The --dtype names of qvl.bridges.convert.DTYPES (tests/launchers/test_cli.py holds them equal). The command
# table imports every command module for each `qvl` call, so this one imports torch and the converter only when
# a convert command runs.
DTYPE_NAMES = ("bf16", "fp32", "fp16")


def _ranks(args: argparse.Namespace):
    from qvl.foundation.distributed import run_on_ranks

    return lambda fn, *a: run_on_ranks(
        fn, *a, tensor_parallel=args.tp, pipeline_parallel=args.pp, cpu=True if args.device == "cpu" else None
    )


AGAIN = "then run the same command again: it writes the checkpoint anew"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def run_import(args: argparse.Namespace) -> int:
    from qvl.bridges import convert
    from qvl.foundation.distributed import run_on_ranks

    # One process streams the checkpoint; it loads at any layout, and --tp/--pp are checked against the model.
    with os_errors_as(ConversionError, where=args.out_dir, then=AGAIN):
        (result,) = run_on_ranks(
            convert.import_on_rank,
            args.hf_path,
            args.out_dir,
            args.dtype,
            args.tp,
            args.pp,
            cpu=True if args.device == "cpu" else None,
        )
    print(
        f"wrote Megatron checkpoint {args.out_dir} ({args.dtype}; loads at any TP/PP, checked for TP={args.tp}, "
        f"PP={args.pp}) in {result['seconds']:.1f} s; peak RSS {_gib(result['peak_rss_bytes'])}"
    )
    return 0


def run_export(args: argparse.Namespace) -> int:
    import tempfile

    from qvl.bridges import convert

    convert.refuse_adapters(Path(args.megatron_dir))  # in this process: one clear line before any rank starts
    with tempfile.TemporaryDirectory(prefix="qvl-hf-side-") as side:
        hf_side = str(convert.hf_side_from(Path(args.hf), Path(args.megatron_dir), Path(side))) if args.hf else None
        convert.check_export_inputs(Path(args.megatron_dir), hf_side)
        with os_errors_as(ConversionError, where=args.out_hf_dir, then=AGAIN):
            results = _ranks(args)(
                convert.export_on_rank, args.megatron_dir, args.out_hf_dir, hf_side, not args.no_verify, args.tolerance
            )
    print(
        f"wrote HF checkpoint {args.out_hf_dir} in {results[0]['seconds']:.1f} s; "
        f"peak RSS {_gib(max(r['peak_rss_bytes'] for r in results))}"
    )
    if args.no_verify:
        return 0
    (report,) = [r["check"] for r in results if r["check"] is not None]
    print(
        f"checked against the trained model (loaded from its checkpoint as training resumes): fp32 logits max "
        f"|diff| {report['max_abs_diff']:.3g}, top-1 agreement {report['top1_agreement']:.1%} over "
        f"{report['tokens']} tokens (tolerance {report['tolerance']:.3g})"
    )
    print("OK" if report["ok"] else "FAILED: the exported checkpoint is not the model the run trained")
    return 0 if report["ok"] else 1


def run_verify(args: argparse.Namespace) -> int:
    from qvl.bridges import convert

    convert.check_before_verify(Path(args.hf_path), Path(args.megatron_dir))  # in this process: one clear line
    # Megatron prints progress to stdout; with --json stdout carries the report alone, so it pipes into jq.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        results = _ranks(args)(
            convert.verify_on_rank, args.hf_path, args.megatron_dir, args.tolerance, not args.no_video
        )
    (report,) = [r for r in results if r is not None]
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"logits: max |diff| {report['max_abs_diff']:.3g}, mean {report['mean_abs_diff']:.3g}, "
            f"top-1 agreement {report['top1_agreement']:.1%} over {report['tokens']} tokens "
            f"(tolerance {report['tolerance']:.3g})"
        )
        if report.get("mtp_max_abs_diff") is not None:  # Qwen3.5's multi-token-prediction head
            print(
                f"MTP logits vs the published MTP head: max |diff| {report['mtp_max_abs_diff']:.3g}, "
                f"top-1 agreement {report['mtp_top1_agreement']:.1%}"
            )
        print(f"export: {report['tensors_compared']} tensors compared, {len(report['tensors_different'])} different")
        for name in report["tensors_different"][:20]:
            print(f"  differs: {name}")
        print("OK" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


def run_export_adapter(args: argparse.Namespace) -> int:
    from qvl.bridges import adapter_check, adapter_export, adapter_vllm
    from qvl.foundation.distributed import run_on_ranks

    # Refusals (not a PEFT run, no or another base) in this process: one clear line before any rank starts.
    run = adapter_export.find_adapter_run(Path(args.run_or_checkpoint))
    hf_base = adapter_export.hf_base_of(run, args.hf_base)
    adapter_export.check_base_matches(run, hf_base)
    if args.target == "vllm" and args.merged:
        raise ConversionError("--merged and --for vllm are two outputs; pass one (--for vllm writes a merged base too)")
    cpu = True if args.device == "cpu" else None
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.target == "vllm":
            (report,) = run_on_ranks(
                adapter_vllm.export_vllm_on_rank, args.run_or_checkpoint, str(hf_base), args.out,
                not args.no_verify, args.tolerance, cpu=cpu,
            )  # fmt: skip
        else:
            adapter, merged = (None, args.out) if args.merged else (args.out, None)
            (report,) = run_on_ranks(
                adapter_check.export_adapter_on_rank, args.run_or_checkpoint, str(hf_base), adapter, merged,
                not args.no_verify, args.tolerance, cpu=cpu,
            )  # fmt: skip
            written = adapter_vllm.read_adapter_config(Path(adapter)) if adapter else None
            report["vllm"] = [g.as_dict() for g in adapter_vllm.groups_of_config(written)] if written else []
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.target == "vllm":
        _print_vllm_export(report)
    else:
        _print_adapter_report(report)
    return 0 if report["ok"] else 1


def _print_vllm_view(groups: list[dict], rank: int | None) -> None:
    from qvl.bridges.adapter_vllm import DEFAULT_MAX_LORA_RANK, max_lora_rank

    print("vLLM's view of the adapter (its LoRA loader, per adapted module group):")
    for g in groups:
        print(f"  {g['group']} ({g['modules']}): {'served' if g['served'] else 'NOT served'}: {g['why']}")
    needed = max_lora_rank(rank) if rank else None
    if needed and needed > DEFAULT_MAX_LORA_RANK and any(g["served"] for g in groups):
        print(
            f"  rank {rank}: vllm serve needs --max-lora-rank {needed} (its default {DEFAULT_MAX_LORA_RANK} refuses it)"
        )


def _print_vllm_export(report: dict) -> None:
    _print_vllm_view(report["groups"], report["rank"])
    print(f"wrote what vLLM serves exactly to {report['out']} (vllm.json records this view):")
    print(f"  base: {report['base']}" + ("" if report["adapter"] else " (every adapter folded in: serve it alone)"))
    if report["adapter"]:
        print(f"  adapter: {report['adapter']} (the groups vLLM serves; the others are folded into the base)")
    print(f"  serve: {report['serve']}")
    if report["checked"]:
        print(
            f"fp32 logits vs the trained model (loaded as training resumes): max |diff| {report['max_abs_diff']:.3g} "
            f"(the adapters move them by up to {report['adapter_effect']:.3g})"
        )
        _print_keys_and_verdict(report)


def _print_keys_and_verdict(report: dict) -> None:
    for what in ("missing_keys", "unexpected_keys"):
        for key in report[what][:10]:
            print(f"  {what.replace('_', ' ')[:-1]}: {key}")
    verdict = "OK" if report["ok"] else "FAILED: the exported files are not the model the run trained"
    print(f"{verdict} (tolerance {report['tolerance']:.3g})")


def _print_adapter_report(report: dict) -> None:
    if report["adapter"]:
        print(f"wrote peft adapter {report['adapter']} (adapter_config.json + adapter_model.safetensors)")
    if report["merged"]:
        print(f"wrote HF checkpoint {report['merged']} with the adapters merged into its weights")
    if report["vllm"]:
        written = json.loads((Path(report["adapter"]) / "adapter_config.json").read_text())
        _print_vllm_view(report["vllm"], int(written["r"]))
        if not all(g["served"] for g in report["vllm"]):
            print("  to serve exactly what was trained with vLLM: the same command with --for vllm")
    elif report["merged"]:
        print("vLLM serves the merged checkpoint as a plain model, as trained (vllm serve, no LoRA)")
    if not report["checked"]:
        return
    print(f"fp32 logits of the trained model (loaded as training resumes): the adapters move them by up to "
          f"{report['adapter_effect']:.3g}")  # fmt: skip
    if report["adapter_effect"] < 1e-6:
        print("  note: the adapters do not change the logits (untrained: B is zero), so this comparison sees nothing")
    if report["adapter_max_abs_diff"] is not None:
        print(f"  vs transformers + peft with the adapter: max |diff| {report['adapter_max_abs_diff']:.3g}")
    if report["merged_max_abs_diff"] is not None:
        print(f"  vs transformers with the merged checkpoint: max |diff| {report['merged_max_abs_diff']:.3g}")
    _print_keys_and_verdict(report)


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks started on this machine)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces the CPU runtime")


def register(subparsers) -> None:
    """Add `qvl convert` and its subcommands."""
    convert_parser = subparsers.add_parser("convert", help="HF <-> Megatron checkpoint conversion with logit parity")
    commands = convert_parser.add_subparsers(dest="convert_command", metavar="COMMAND", required=True)
    imp = commands.add_parser("import", help="HF directory -> Megatron distributed checkpoint")
    imp.add_argument("hf_path")
    imp.add_argument("out_dir")
    imp.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16")
    _layout_args(imp)
    imp.set_defaults(func=run_import)
    exp = commands.add_parser("export", help="Megatron checkpoint -> HF safetensors + config")
    exp.add_argument("megatron_dir", help="a `qvl train` run directory, its checkpoints, or a `qvl convert import`")
    exp.add_argument("out_hf_dir")
    exp.add_argument("--hf", metavar="HF_DIR", help="the HF side (config, tokenizer) where the checkpoint keeps none")
    exp.add_argument("--no-verify", action="store_true", help="skip the logit comparison with the trained model")
    exp.add_argument("--tolerance", type=float, default=None, help="max |logit diff| (default 1e-4, fp32)")
    _layout_args(exp)
    exp.set_defaults(func=run_export)
    ver = commands.add_parser("verify", help="compare logits and exported tensors; non-zero exit above tolerance")
    ver.add_argument("hf_path")
    ver.add_argument("megatron_dir")
    ver.add_argument("--json", action="store_true", help="print the report as JSON")
    ver.add_argument("--report", metavar="FILE", help="also write the JSON report to FILE")
    ver.add_argument("--tolerance", type=float, default=None, help="max |logit diff| (default: 1e-4 fp32, 0.25 bf16)")
    ver.add_argument("--no-video", action="store_true", help="images and text only")
    _layout_args(ver)
    ver.set_defaults(func=run_verify)
    ada = commands.add_parser(
        "export-adapter",
        help="a PEFT run's adapters -> HF peft adapter (or a merged checkpoint), checked against transformers + peft",
    )
    ada.add_argument("run_or_checkpoint", help="a `qvl train` run directory of a *_peft recipe, or its checkpoints")
    ada.add_argument(
        "hf_base", nargs="?", help="the HF checkpoint the run fine-tuned from (default: the run's hf_path)"
    )
    ada.add_argument(
        "out", help="folder for adapter_config.json + adapter_model.safetensors (with --merged: the HF model)"
    )
    ada.add_argument(
        "--merged", action="store_true", help="write a full HF checkpoint with the adapters folded in instead"
    )
    ada.add_argument(
        "--for", dest="target", choices=("peft", "vllm"), default="peft",
        help="vllm: OUT/base (what vLLM would not serve folded in) + OUT/adapter (what it serves as trained)",
    )  # fmt: skip
    ada.add_argument("--no-verify", action="store_true", help="skip the logit comparison with the trained model")
    ada.add_argument("--tolerance", type=float, default=None, help="max |logit diff| (default 1e-5, fp32)")
    ada.add_argument("--json", action="store_true", help="print the report as JSON")
    ada.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces the CPU runtime")
    ada.set_defaults(func=run_export_adapter)


if __name__ == "__main__":
    from qvl.launchers.cli import main

    sys.exit(main(["convert", *sys.argv[1:]]))
