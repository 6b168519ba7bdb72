"""HF <-> Megatron checkpoint conversion through Megatron-Bridge's AutoBridge, at any TP/PP layout.

`import_checkpoint` streams the HF weights into a torch_dist checkpoint in one process (qvl.bridges.stream);
the checkpoint loads at any TP/PP. `export_checkpoint` and verification run inside an initialised
distributed context at the layout asked for (one process per rank; `run_on_ranks` starts them here). The Megatron checkpoint directory also keeps
the small HF files (config, tokenizer, processor) under `hf/`, so export needs nothing else.
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qvl.bridges import unconverted, verify
from qvl.bridges.checkpoints import (
    HF_FILES_DIR,
    LATEST_FILE,
    adapter_settings,
    check_megatron_checkpoint,
    checkpoints_of,
)
from qvl.bridges.consistency import check_hf_checkpoint
from qvl.bridges.mtp_reference import mtp_layers_in_checkpoint
from qvl.bridges.providers import auto_bridge, layout_facts
from qvl.bridges.stream import save_streaming
from qvl.foundation import patches
from qvl.foundation.errors import ConfigError, ConversionError
from qvl.foundation.families import FAMILIES
from qvl.foundation.layout import ParallelLayout, check_layout
from qvl.foundation.megatron import import_megatron_bridge
from qvl.kernels import speed_aligned_widths, speed_cuda_graphs, torch_wgrad_accum

logger = logging.getLogger(__name__)

# Everything in an HF checkpoint directory except the weights: needed to export and to run the model.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(kw_only=True, slots=True)
class ConversionResult:
    """What a conversion wrote and what it cost."""

    output: Path
    seconds: float
    peak_rss_bytes: int
    tensor_parallel: int
    pipeline_parallel: int


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


SUPPORTED_ARCHITECTURES = tuple(f.hf_architecture for f in FAMILIES.values())


def require_qwen_vl(hf_path: Path) -> str:
    """The checkpoint's architecture, or an error listing the ones qvl converts."""

    check_hf_dir(Path(hf_path))
    try:
        config = json.loads((Path(hf_path) / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{hf_path}/config.json is not valid JSON ({err}); the checkpoint is corrupt") from err
    architectures = config.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ConversionError(
            f"{hf_path}: architecture {architectures or 'unknown'} is not supported; "
            f"qvl converts {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return supported[0]


def check_before_verify(hf_path: Path, megatron_dir: Path) -> None:
    """Everything `verify` can refuse before starting ranks: both checkpoints' files and their consistency."""
    require_qwen_vl(Path(hf_path))
    check_hf_checkpoint(Path(hf_path))
    check_megatron_checkpoint(checkpoints_of(Path(megatron_dir)), "MEGATRON_DIR")


def check_hf_dir(hf_path: Path) -> None:
    """Fail early, naming the file, when an HF checkpoint directory is incomplete."""
    if not hf_path.is_dir():
        raise ConversionError(
            f"{hf_path} is not a directory; pass an HF checkpoint directory (config.json + *.safetensors)"
        )
    if not (hf_path / "config.json").is_file():
        raise ConversionError(f"{hf_path} has no config.json; it is not a Hugging Face checkpoint directory")
    if not any(hf_path.glob("*.safetensors")) and not any(hf_path.glob("*.bin")):
        raise ConversionError(f"{hf_path} has no weights (*.safetensors or *.bin)")


def copy_hf_side_files(src: Path, dst: Path) -> None:
    """Copy config, tokenizer and processor files (not weights) from one HF-style directory to another."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        weights = path.name.endswith(_WEIGHT_SUFFIXES) and path.name != unconverted.UNCONVERTED_FILE
        if path.is_file() and not weights and not path.name.endswith(".index.json"):
            shutil.copy2(path, dst / path.name)


def write_hf_side(hf_path: Path, side_dir: Path, *, kept_aside: bool = True) -> None:
    """An HF checkpoint's side files in `side_dir` (a Megatron checkpoint's `hf/`): config, tokenizer and processor,
    its tensor names (the export writes the same layout back) and, with `kept_aside`, the tensors conversion keeps
    aside (e.g. Qwen3.5's mtp.*: kept, not dropped)."""
    copy_hf_side_files(Path(hf_path), Path(side_dir))
    if kept_aside:
        unconverted.save_unconverted(Path(hf_path), Path(side_dir))
    unconverted.save_tensor_names(Path(hf_path), Path(side_dir))


def import_checkpoint(
    hf_path: Path, out_dir: Path, *, dtype: str = "bf16", tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> ConversionResult:
    """HF directory -> Megatron torch_dist checkpoint, streamed one tensor at a time (qvl.bridges.stream).

    Runs in one process. A torch_dist checkpoint holds global tensors, so training loads it at any TP/PP;
    `tensor_parallel` and `pipeline_parallel` are the layout it will be trained with, checked to divide the
    model's heads and layers before anything is written.
    """
    started = time.perf_counter()
    hf_path, out_dir = Path(hf_path), Path(out_dir)
    require_qwen_vl(hf_path)
    check_hf_checkpoint(hf_path)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if torch.distributed.get_world_size() != 1:
        raise ConversionError(
            f"import runs in one process (got {torch.distributed.get_world_size()}); the checkpoint "
            "it writes loads at any TP/PP, so start it on one rank"
        )
    bridge = auto_bridge_with_weights(hf_path, DTYPES[dtype])
    provider = bridge.to_megatron_provider(load_weights=False)
    _fix(provider, bridge)
    if getattr(provider, "mtp_num_layers", None):  # the MTP layers the checkpoint's tensors hold (Qwen3.5's mtp.*)
        provider.mtp_num_layers = mtp_layers_in_checkpoint(hf_path, provider.mtp_num_layers) or None
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tensor_parallel, pipeline_parallel
    check_checkpoint_layout(provider)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = 1
    provider.params_dtype = provider.pipeline_dtype = DTYPES[dtype]
    provider.bf16, provider.fp16 = dtype == "bf16", dtype == "fp16"
    provider.perform_initialization = False  # as Megatron-Bridge sets it for a weights-loading provider
    provider.finalize()
    with patches.applied(
        speed_aligned_widths.GROUP
    ):  # HF tensors zero-padded to the aligned widths the provider builds
        save_streaming(bridge, provider, out_dir, hf_tokenizer_path=str(hf_path))
    write_hf_side(hf_path, out_dir / HF_FILES_DIR)
    return ConversionResult(
        output=out_dir,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=peak_rss_bytes(),
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
    )


def auto_bridge_with_weights(hf_path: Path, dtype: torch.dtype):
    """An AutoBridge over an HF checkpoint directory whose weights stream from its safetensors files."""
    import_megatron_bridge()
    from megatron.bridge import AutoBridge

    import qvl.bridges.registration  # noqa: F401

    require_qwen_vl(hf_path)
    return AutoBridge.from_hf_pretrained(str(hf_path), dtype=dtype)


def _fix(provider, bridge) -> None:
    from qvl.bridges.fixes import fix_provider

    fix_provider(provider, bridge.hf_pretrained.config)


def check_checkpoint_layout(provider) -> None:
    """TP must divide the heads and query groups, PP the decoder layers (a checkpoint's layout is even)."""
    layout = ParallelLayout(
        tensor_parallel=provider.tensor_model_parallel_size, pipeline_parallel=provider.pipeline_model_parallel_size
    )
    try:
        check_layout(layout_facts(provider, "the checkpoint"), layout, even_pipeline=True)
    except ConfigError as err:
        raise ConversionError(f"--tp/--pp: {err}") from err


def export_checkpoint(megatron_dir: Path, out_hf_dir: Path, *, hf_side: Path | None = None) -> ConversionResult:
    """Megatron checkpoint (written by `import_checkpoint` or training; a run directory names its checkpoints) ->
    HF safetensors + config (collective). The HF side (config, tokenizer, kept-aside tensors) is the checkpoint's
    `hf/` folder, or `hf_side` (what `--hf HF_DIR` gives)."""
    started = time.perf_counter()
    megatron_dir, out_hf_dir = checkpoints_of(Path(megatron_dir)), Path(out_hf_dir)
    hf_files = check_export_inputs(megatron_dir, hf_side)
    bridge = auto_bridge(hf_files)
    model = load_megatron(bridge, megatron_dir)
    with patches.applied(speed_aligned_widths.GROUP):  # padded widths cut back to the checkpoint's
        bridge.save_hf_pretrained(model, out_hf_dir, show_progress=False)
    if torch.distributed.get_rank() == 0:
        unconverted.restore_unconverted(hf_files, out_hf_dir)
        for path in hf_files.iterdir():  # tokenizer + processor files the bridge does not write
            if not (out_hf_dir / path.name).exists() and path.name not in unconverted.BOOKKEEPING_FILES:
                shutil.copy2(path, out_hf_dir / path.name)
    torch.distributed.barrier()
    return ConversionResult(
        output=out_hf_dir,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=peak_rss_bytes(),
        tensor_parallel=1,
        pipeline_parallel=1,
    )


def check_export_inputs(megatron_dir: Path, hf_side: Path | None = None) -> Path:
    """Refuse what export cannot write (a PEFT run's adapters, no HF side); returns the HF side folder it reads."""
    megatron_dir = checkpoints_of(Path(megatron_dir))
    refuse_adapters(megatron_dir)
    hf_files = Path(hf_side) if hf_side else megatron_dir / HF_FILES_DIR
    if not (hf_files / "config.json").is_file():
        raise ConversionError(
            f"{megatron_dir} has no {HF_FILES_DIR}/config.json (a run trained from scratch, or from a checkpoint "
            "`qvl convert import` did not write); pass --hf HF_DIR, the HF checkpoint it started from or one of its "
            "architecture"
        )
    return hf_files


def hf_side_from(hf_path: Path, megatron_dir: Path, side_dir: Path) -> Path:
    """`--hf HF_DIR` as an HF side folder in `side_dir`: its config, tokenizer, processor and tensor names, and its
    kept-aside tensors where the run fine-tuned from a checkpoint (a run from scratch never had them)."""
    require_qwen_vl(Path(hf_path))
    iteration = check_megatron_checkpoint(checkpoints_of(Path(megatron_dir)), "MEGATRON_DIR")
    fine_tuned = True
    if (iteration / "run_config.yaml").is_file():
        import yaml

        run_config = yaml.safe_load((iteration / "run_config.yaml").read_text()) or {}
        fine_tuned = bool((run_config.get("checkpoint") or {}).get("pretrained_checkpoint"))
    write_hf_side(Path(hf_path), Path(side_dir), kept_aside=fine_tuned)
    return Path(side_dir)


def check_export(megatron_dir: Path, out_hf_dir: Path, tolerance: float | None) -> dict | None:
    """The exported checkpoint's fp32 logits (transformers) against those of the model the run trained, loaded from
    its checkpoint as training resumes (qvl.bridges.trained), on verify's inputs; the report on the last pipeline
    stage's first TP rank, None elsewhere (collective)."""
    from megatron.core import parallel_state

    from qvl.bridges import trained

    files = check_hf_checkpoint(Path(out_hf_dir))
    if files.tokenizer and files.processor:
        inputs = verify.reference_inputs(Path(out_hf_dir))
    else:
        inputs = verify.config_inputs(Path(out_hf_dir))
    ours, _ = trained.trained_logits(checkpoints_of(Path(megatron_dir)), inputs)
    if ours is None or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    reference = verify.hf_logits(Path(out_hf_dir), inputs)
    report = verify.build_report(reference, ours, 0, [], tolerance or verify.DEFAULT_TOLERANCE)
    return report.as_dict() | {"checked_against": "the trained model, loaded from its checkpoint as training resumes"}


def refuse_adapters(megatron_dir: Path) -> None:
    """A PEFT run's checkpoint holds its adapters alone: refuse it as a full model, naming the command that exports it."""
    megatron_dir = checkpoints_of(Path(megatron_dir))
    is_checkpoint = any((megatron_dir / name).is_file() for name in (LATEST_FILE, ".metadata"))
    if is_checkpoint and adapter_settings(megatron_dir):
        raise ConversionError(
            f"{megatron_dir} holds a PEFT run's adapters, not a full model; export them with `qvl convert "
            "export-adapter RUN_OR_CHECKPOINT [HF_BASE] OUT` (add --merged for a full HF checkpoint with them merged in)"
        )


def load_megatron(bridge, megatron_dir: Path) -> list:
    """The Megatron model from a checkpoint directory, built with qvl's provider fixes."""
    from megatron.core import parallel_state

    torch_wgrad_accum.provide_kernels()  # a trained checkpoint's run_config.yaml has gradient_accumulation_fusion on
    overrides = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        **speed_cuda_graphs.eager_settings(),  # a run trained with CUDA graphs saved them in its config
    }
    model = bridge.load_megatron_model(str(megatron_dir), mp_overrides=overrides, wrap_with_ddp=False)
    # Built from the checkpoint's run_config.yaml (padded widths, no pre-wrap hooks): the export learns the HF
    # widths from the HF config.
    hf_config = bridge.hf_pretrained.config if hasattr(bridge.hf_pretrained, "config") else bridge.hf_pretrained
    speed_aligned_widths.mark_hf_widths(model, hf_config)
    return model


# --- entry points run on every rank by `qvl convert` (module level, so spawned ranks can import them) ---


def import_on_rank(
    hf_path: str, out_dir: str, dtype: str, tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> dict:
    result = import_checkpoint(
        Path(hf_path), Path(out_dir), dtype=dtype, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel
    )
    return {"seconds": result.seconds, "peak_rss_bytes": result.peak_rss_bytes}


def export_on_rank(
    megatron_dir: str, out_hf_dir: str, hf_side: str | None = None, check: bool = True, tolerance: float | None = None
) -> dict:
    """Export, then (with `check`) compare the export with the trained model: the check's report on one rank."""
    result = export_checkpoint(Path(megatron_dir), Path(out_hf_dir), hf_side=Path(hf_side) if hf_side else None)
    report = check_export(Path(megatron_dir), Path(out_hf_dir), tolerance) if check else None
    return {"seconds": result.seconds, "peak_rss_bytes": peak_rss_bytes(), "check": report}


def verify_on_rank(hf_path: str, megatron_dir: str, tolerance: float | None, video: bool) -> dict | None:
    """Logit parity and per-tensor export equality; the last pipeline stage's rank 0 returns the report."""
    from megatron.core import parallel_state

    # A weights-backed bridge: its export names follow the checkpoint's own layout (e.g. fused MoE experts).
    megatron_dir = str(checkpoints_of(Path(megatron_dir)))
    files = check_hf_checkpoint(Path(hf_path))
    bridge = auto_bridge_with_weights(Path(hf_path), torch.float32)
    model = load_megatron(bridge, Path(megatron_dir))
    # Without tokenizer or processor files (a model saved with save_pretrained alone) the inputs come from config.json.
    if files.tokenizer and files.processor:
        inputs = verify.reference_inputs(Path(hf_path), video=video)
    else:
        inputs = verify.config_inputs(Path(hf_path))
    mtp = bool(getattr(model[0].config, "mtp_num_layers", None))  # the MTP head too (qvl.bridges.mtp_reference)
    ours = verify.megatron_logits(model, inputs, mtp=mtp)
    with patches.applied(speed_aligned_widths.GROUP):
        compared, different = verify.compare_exported_tensors(bridge, model, Path(hf_path))
    kept, different = unconverted.sort_out_kept(different, Path(hf_path), Path(megatron_dir) / HF_FILES_DIR)
    if ours is None or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    if tolerance is None:  # fp32 parity is ~3e-7; bf16 weights round every matmul input
        tolerance = verify.DEFAULT_TOLERANCE if model[0].config.params_dtype == torch.float32 else 0.25
    if mtp:
        reference, mtp_reference = verify.hf_logits_and_mtp(Path(hf_path), inputs)
    else:
        reference, mtp_reference = verify.hf_logits(Path(hf_path), inputs), None
    report = verify.build_report(reference, ours, compared, different, tolerance, mtp_reference=mtp_reference)
    return report.as_dict() | {"tensors_kept_aside": kept, "peak_rss_bytes": peak_rss_bytes()}
