"""Streaming HF -> Megatron import: the checkpoint is written one tensor at a time, never the whole model.

Megatron-Bridge's import (megatron-bridge 0.6.2, `AutoBridge.save_megatron_model`) builds the Megatron model,
copies every HF tensor into it, then saves it, so peak memory follows the model's size. Here the same pieces
of Megatron-Bridge run in a different order:

1. the Megatron model is built on the meta device: names, shapes, dtypes and the sharded-state-dict layout,
   no storage;
2. Megatron-Bridge's conversion tasks (`build_conversion_tasks`) say which HF tensors make each parameter and
   which mapping converts them;
3. Megatron-Bridge's own `save_checkpoint` writes the torch_dist checkpoint (directory layout, common state,
   run_config.yaml, tokenizer assets) through `StreamingSaveStrategy`, whose planner converts a parameter when
   PyTorch's writer asks for one of its chunks and drops it once that chunk is on disk.

So the peak holds one parameter's HF source tensors and its converted copy (plus a grouped MoE tensor that
several parameters slice), whatever the depth. The files are the ones Megatron-Bridge's import writes: same
keys, shapes, dtypes and bytes (tests/bridges/test_stream.py compares them).

A torch_dist checkpoint stores global tensors, so any TP/PP layout loads it; the import therefore runs in one
process with the TP=PP=1 model, and `--tp/--pp` only check that the layout will divide the model.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from qvl.foundation.errors import ConversionError

# Converted parameters kept for chunks that come later (gated-MLP halves, a fused MoE tensor's experts):
# the writer asks for the chunks of one parameter one after another, so two is enough.
_CACHED_PARAMETERS = 2
# HF tensors are read through a buffer of this size (a constant in the import's memory).
_READ_BUFFER_BYTES = 16 * 2**20
# safetensors dtype names (the format's header) -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFiles:
    """Tensors of an HF checkpoint directory by name, each read into fresh memory with plain file reads.

    Not memory-mapped: pages of a mapped shard count in the process's RSS for as long as the mapping lives,
    and a copy made from them doubles the tensor's footprint while both exist.
    """

    def __init__(self, hf_path: Path) -> None:
        self.entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for path in sorted(Path(hf_path).glob("*.safetensors")):
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    start, end = entry["data_offsets"]
                    self.entries[name] = (path, entry["dtype"], entry["shape"], 8 + length + start, end - start)
        if not self.entries:
            raise ConversionError(
                f"{hf_path} has no *.safetensors weights; qvl imports safetensors only: load the model "
                "in transformers and save_pretrained() it again (safetensors is the default)"
            )

    def keys(self):
        return self.entries.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise KeyError(f"tensor {name} is in none of the *.safetensors files; the checkpoint is incomplete")
        path, dtype, shape, offset, size = self.entries[name]
        # Read through a fixed buffer, not into the tensor's memory directly: memory that numpy or a Python
        # buffer has seen cannot be freed early (the streaming planner frees each tensor once written).
        data, buffer = torch.empty(size, dtype=torch.uint8), bytearray(min(size, _READ_BUFFER_BYTES))
        with path.open("rb") as f:
            f.seek(offset)
            for start in range(0, size, len(buffer)):
                view = memoryview(buffer)[: min(len(buffer), size - start)]
                if f.readinto(view) != len(view):
                    raise OSError(f"{path} ends inside tensor {name}; the file is truncated, download it again")
                data[start : start + len(view)] = torch.frombuffer(view, dtype=torch.uint8)
        return data.view(_SAFETENSORS_DTYPES[dtype]).reshape(shape)


def _is_meta(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "meta") or value == "meta"


class _MetaTargetsOnCpu(TorchFunctionMode):
    """Rewrites meta device arguments (`x.to(target.device)`, `torch.empty(..., device=target.device)`) to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_meta(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple(
                "cpu" if i > 0 and not isinstance(a, torch.Tensor) and _is_meta(a) else a for i, a in enumerate(args)
            )
        return func(*args, **kwargs)


@dataclass(kw_only=True, slots=True)
class _Source:
    """How to make the data of one checkpoint chunk: which parameter, and the factory that splits it (if any)."""

    parameter: torch.nn.Parameter
    name: str
    factory: Any = None  # a Megatron-Core ShardedTensorFactory, rebuilt on the real tensor


class StreamingConverter:
    """Converts one Megatron parameter at a time from an HF checkpoint, for a meta-device model."""

    def __init__(self, bridge, model: list) -> None:
        self.model_bridge = bridge._model_bridge
        self.hf_state = SafetensorsFiles(Path(bridge.hf_pretrained.model_name_or_path))
        tasks = [t for t in self.model_bridge.build_conversion_tasks(bridge.hf_pretrained, model) if t is not None]
        self.tasks = {id(t.param_weight): t for t in tasks}
        self._converted: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._grouped: dict[str, Any] = {}  # one fused HF tensor that several parameters slice (MoE experts)
        self.converted_parameters = 0

    def missing(self, model: list) -> list[str]:
        """Parameters no conversion task fills (they would be written uninitialised)."""
        return [name for m in model for name, p in m.named_parameters() if id(p) not in self.tasks]

    def parameter(self, parameter: torch.nn.Parameter, name: str, *, keep: bool) -> torch.Tensor:
        """The real value of a meta parameter, converted from the HF tensors it comes from.

        `keep`: the parameter has more chunks to come (a factory splits it), so keep it for them.
        """
        key = id(parameter)
        if key in self._converted:
            self._converted.move_to_end(key)
            return self._converted[key]
        task = self.tasks.get(key)
        if task is None:
            raise ConversionError(f"no Megatron-Bridge mapping fills {name}; the checkpoint would hold no value for it")
        mapping = task.mapping
        hf_key = str(mapping.hf_param)
        if getattr(mapping, "is_grouped_export", False):
            if hf_key not in self._grouped:
                self._grouped = {
                    hf_key: self.model_bridge.maybe_modify_loaded_hf_weight(mapping.hf_param, self.hf_state)
                }
            hf_weights = self._grouped[hf_key]
        else:
            hf_weights = self.model_bridge.maybe_modify_loaded_hf_weight(mapping.hf_param, self.hf_state)
        with _MetaTargetsOnCpu():  # the mappings put their output on the (meta) target parameter's device
            converted = mapping.hf_to_megatron(hf_weights, task.megatron_module)
        if tuple(converted.shape) != tuple(parameter.shape):
            raise ConversionError(
                f"{name}: HF {mapping.hf_param} converts to shape {tuple(converted.shape)}, "
                f"the model expects {tuple(parameter.shape)}; the checkpoint does not match its config.json"
            )
        converted = converted.detach().to(device="cpu", dtype=parameter.dtype)
        self.converted_parameters += 1
        if keep:
            self._converted[key] = converted
            while len(self._converted) > _CACHED_PARAMETERS:
                self._converted.popitem(last=False)
        return converted

    def private_copy(self, data: torch.Tensor) -> torch.Tensor:
        """`data` itself when nothing else uses its memory, else a copy: the writer may then free it."""
        shared = data.untyped_storage().nbytes() != data.nbytes or data.data_ptr() != data.untyped_storage().data_ptr()
        kept = {
            t.untyped_storage().data_ptr()
            for t in [*self._converted.values(), *self._grouped.values()]
            if isinstance(t, torch.Tensor)
        }
        return data.clone() if shared or data.untyped_storage().data_ptr() in kept else data


def chunk_sources(sharded_state_dict: dict, names: dict[int, str]) -> dict[tuple[str, tuple[int, ...]], _Source]:
    """(checkpoint key, global offset) -> the parameter (and factory) its data comes from.

    Factories (e.g. Megatron-Core's gated-MLP split into two chunks) run here on the meta tensor only to
    learn the keys and offsets they produce; at write time they run again on the converted tensor.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sources = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and id(value.data) in names:
            sources[(value.key, tuple(value.global_offset))] = _Source(parameter=value.data, name=names[id(value.data)])
        elif isinstance(value, ShardedTensorFactory) and id(value.data) in names:
            built = value.build_fn(value.key, value.data, value.replica_id, value.flattened_range)
            for piece in _pieces(built):
                sources[(piece.key, tuple(piece.global_offset))] = _Source(
                    parameter=value.data, name=names[id(value.data)], factory=value
                )
    return sources


def _pieces(built) -> list:
    """The ShardedTensors a factory built (one, or nested in lists and dicts)."""
    if isinstance(built, dict):
        built = list(built.values())
    if isinstance(built, (list, tuple)):
        return [piece for item in built for piece in _pieces(item)]
    return [built]


def _chunk(converter: StreamingConverter, source: _Source, key: str, offset: tuple[int, ...]) -> torch.Tensor:
    """The data of one checkpoint chunk, from the converted parameter."""
    value = converter.parameter(source.parameter, source.name, keep=source.factory is not None)
    if source.factory is None:
        return value
    built = source.factory.build_fn(
        source.factory.key, value, source.factory.replica_id, source.factory.flattened_range
    )
    for piece in _pieces(built):
        if piece.key == key and tuple(piece.global_offset) == offset:
            return piece.data
    raise KeyError(f"the factory for {source.name} no longer makes chunk {key} at {offset}")


def streaming_save_strategy(converter: StreamingConverter, sources: dict, progress=None):
    """A Megatron-Core save strategy whose writer converts each tensor chunk as it writes it."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class StreamingPlanner(MCoreSavePlanner):
        written: torch.Tensor | None = None

        def resolve_data(self, write_item):
            self.free_written()
            index = write_item.index
            source = sources.get((index.fqn, tuple(index.offset or ())))
            if source is None:  # bytes (extra state, common state) or a tensor no mapping fills
                data = super().resolve_data(write_item)
                if isinstance(data, torch.Tensor) and data.is_meta:
                    raise ConversionError(f"no Megatron-Bridge mapping fills checkpoint tensor {index.fqn}")
                return data
            data = _chunk(converter, source, index.fqn, tuple(index.offset))
            if progress is not None:
                progress()
            # Prepended (layer) axes are size 1. A private tensor: PyTorch 2.14's FileSystemWriter keeps a
            # reference to every tensor it wrote until the file ends (for its safetensors format only), so
            # its memory is released here, when the writer asks for the next chunk, and after the last.
            self.written = converter.private_copy(data.reshape(write_item.tensor_data.chunk.sizes))
            return self.written

        def free_written(self) -> None:
            if self.written is not None:
                self.written.untyped_storage().resize_(0)
                self.written = None

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            # One thread and no copy-ahead (which a visible GPU would otherwise switch on): PyTorch's writer
            # then resolves (converts) the chunks one by one, in plan order, each after the last is written.
            writer = FileSystemWriter(
                str(checkpoint_dir), single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0
            )
            planner = StreamingPlanner(
                dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False
            )
            dcp_save(state_dict, storage_writer=writer, planner=planner)
            planner.free_written()

    return StreamingSaveStrategy("torch_dist", 1)


def meta_model(provider) -> list:
    """The Megatron model on the meta device (no storage), one process, TP=PP=1."""
    with torch.device("meta"):
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    on_storage = [n for m in model for n, p in m.named_parameters() if not p.is_meta]
    if on_storage:
        raise RuntimeError(
            f"{len(on_storage)} parameters were built with storage despite the meta device, e.g. "
            f"{on_storage[:3]}; the streaming import cannot bound memory for this model"
        )
    return model


def save_streaming(bridge, provider, out_dir: Path, *, hf_tokenizer_path: str | None) -> int:
    """Write the torch_dist checkpoint of `bridge`'s HF weights at `out_dir`; returns tensors converted."""
    from megatron.bridge.training.checkpointing import (
        _build_sharded_state_dict_metadata,
        generate_state_dict,
        get_rng_state,
        save_checkpoint,
    )
    from megatron.bridge.training.utils.pg_utils import get_pg_collection
    from rich.progress import Progress

    model = meta_model(provider)
    converter = StreamingConverter(bridge, model)
    missing = converter.missing(model)
    if missing:
        raise ConversionError(f"no Megatron-Bridge mapping fills {len(missing)} parameters, e.g. {missing[:5]}")
    names = {id(t): n for m in model for n, t in [*m.named_parameters(), *m.named_buffers()]}
    state = _checkpoint_state(provider, out_dir, hf_tokenizer_path)
    pg_collection = get_pg_collection(model)
    metadata = _build_sharded_state_dict_metadata(False, state.cfg.checkpoint)
    layout = generate_state_dict(
        state.cfg.checkpoint,
        model,
        None,
        None,
        get_rng_state(False, "torch_dist", pg_collection=pg_collection),
        iteration=0,
        optim_sd_kwargs=dict(metadata=metadata),
        model_sd_kwargs=dict(metadata=metadata),
    )
    sources = chunk_sources(layout, names)
    del layout
    with Progress(transient=True, disable=torch.distributed.get_rank() != 0) as bar:
        task = bar.add_task("converting", total=len(sources))
        strategy = streaming_save_strategy(converter, sources, progress=lambda: bar.advance(task))
        save_checkpoint(
            state=state,
            model=model,
            optimizer=None,
            opt_param_scheduler=None,
            num_floating_point_operations_so_far=0,
            checkpointing_context={"save_strategy": strategy},
            callback_manager=None,
        )
    _save_tokenizer_assets(state, out_dir)
    return converter.converted_parameters


def _checkpoint_state(provider, out_dir: Path, hf_tokenizer_path: str | None):
    """The GlobalState Megatron-Bridge's `save_megatron_model` builds for a weights-only checkpoint."""
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.core.optimizer import OptimizerConfig

    tokenizer = None
    if hf_tokenizer_path is not None:
        tokenizer = TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_tokenizer_path), hf_tokenizer_kwargs={}
        )
    state = GlobalState()
    state.cfg = ConfigContainer(
        model=provider,
        train=None,
        optimizer=OptimizerConfig(use_distributed_optimizer=False),
        ddp=None,
        scheduler=None,
        dataset=None,
        logger=LoggerConfig(),
        tokenizer=tokenizer,
        checkpoint=CheckpointConfig(
            async_save=False,
            save=str(out_dir),
            save_optim=False,
            save_rng=False,
            ckpt_format="torch_dist",
            dist_ckpt_optim_fully_reshardable=True,
        ),
        dist=None,
    )
    return state


def _save_tokenizer_assets(state, out_dir: Path) -> None:
    if state.cfg.tokenizer is None:
        return
    from megatron.bridge.training.checkpointing import get_checkpoint_name, save_tokenizer_assets
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(state.cfg.tokenizer)
    save_tokenizer_assets(tokenizer, state.cfg.tokenizer, get_checkpoint_name(str(out_dir), 0, release=False))
