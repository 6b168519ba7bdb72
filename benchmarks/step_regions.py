"""Where the step census's ops belong (benchmarks.bench_step's training child): the region of the model that runs
(language model, vision tower, loss, optimizer, other) kept by module hooks in forward and tensor hooks in backward,
the parts a CUDA run with `speed-cuda-graphs` replays tallied, and the loader's tensors marked as host tensors."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils import _pytree as pytree


class Regions:
    """Keeps `census.region` on the part of the model that runs: module hooks in forward, tensor hooks in backward
    (a gradient reaching a module's output starts that module's backward), and the grad-finalize function at the
    end of the micro-batches (after it, the optimizer)."""

    def __init__(self, census):
        self.census = census
        self.installed = False
        self.tower = None
        self.tower_calls: list[int] = []  # the pixel rows of each counted tower call

    def set(self, region: str):
        self.census.region = region

    def backward_marker(self, region: str):
        def hook(grad):
            self.set(region)

        return hook

    def mark_output(self, output, region: str) -> None:
        for leaf in pytree.tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple()):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self.backward_marker(region))

    def mark_graphed_layers(self, layers: list) -> None:
        """Tally the ops of the language model's layers, which a CUDA run with `speed-cuda-graphs` replays: their
        forward from the first layer's call to the last one's return, their backward from the gradient reaching the
        last layer's output to the one leaving the first layer's input; and the tensors a replay copies in. Megatron-
        Core's graphs chain the layers (megatron/core/transformer/cuda_graphs.py, 0.19.2): a layer whose input is the
        previous layer's output takes it in that graph's output buffer, and a layer's output gradient arrives in the
        next graph's input-gradient buffer, both without a copy. So each layer call copies its tensors but that
        output, and each chain of layer calls (a micro-batch) copies one output gradient, its last layer's."""
        census = self.census
        if not layers:
            return
        previous = {"output": None}  # the last layer call's output: the next call's input, in its graph's buffer

        def begin(module, args, kwargs):
            census.graph_begin()
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if census.counting:
                census.graphed["lm_layer_calls"] += len(layers)
                census.graphed["lm_layer_chains"] += 1
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad: census.graph_end("lm_layers"))

        def copies_in(module, args, kwargs):
            if census.counting:
                tensors = _tensors((args, kwargs))
                census.graphed["lm_layer_input_copies"] += sum(t is not previous["output"] for t in tensors)

        def keep_output(module, args, kwargs, output):
            previous["output"] = output[0] if isinstance(output, tuple) else output

        for layer in layers:
            layer.register_forward_pre_hook(copies_in, with_kwargs=True)
            layer.register_forward_hook(keep_output, with_kwargs=True)

        def end(module, args, kwargs, output):
            census.graph_end("lm_layers")
            hidden = output[0] if isinstance(output, tuple) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad: census.graph_begin())

        layers[0].register_forward_pre_hook(begin, with_kwargs=True)
        layers[-1].register_forward_hook(end, with_kwargs=True)

    def install(self, model: list, model_config) -> None:
        from megatron.core.utils import unwrap_model

        if self.installed:
            return
        self.installed = True
        vlm = unwrap_model(model[0])
        tower = next((getattr(vlm, n) for n in ("visual", "vision_model") if getattr(vlm, n, None) is not None), None)
        lm = vlm.language_model
        vlm.register_forward_pre_hook(lambda m, a: self.set("lm"))
        self.mark_graphed_layers(list(getattr(lm.decoder, "layers", [])))
        if tower is not None:
            self.tower = tower

            def tower_call(module, args, kwargs):
                self.set("vision")
                if self.census.counting:
                    rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
                    self.census.graphed.update(tower_calls=1, tower_rows=rows)
                    self.tower_calls.append(rows)

            tower.register_forward_pre_hook(tower_call, with_kwargs=True)
            tower.register_forward_hook(lambda m, a, out: (self.mark_output(out, "vision"), self.set("lm"))[1])
        if getattr(lm, "output_layer", None) is not None:

            def before_output_layer(module, args):
                self.set("loss")
                self.mark_output(args[0], "lm")  # its gradient starts the decoder's backward

            lm.output_layer.register_forward_pre_hook(before_output_layer)
        vlm.register_forward_hook(lambda m, a, out: self.mark_output(out, "loss"))
        finalize = model_config.finalize_model_grads_func

        def finalize_then_optimizer(*args, **kwargs):
            self.set("other")
            result = finalize(*args, **kwargs)
            self.set("optimizer")
            return result

        model_config.finalize_model_grads_func = finalize_then_optimizer


def tower_bucket_rows(regions: Regions) -> int:
    """The pixel rows the counted tower calls run graphed: each call's bucket's, the sizes planned from the calls
    themselves, as a run plans them from its dataset's packs (the census's packs are its dataset)."""
    if regions.tower is None:
        return 0
    from qvl.kernels.tower_graphs import TowerGraphs

    graphs = TowerGraphs(regions.tower, cuda=False, planned_calls=regions.tower_calls)
    return sum(graphs.bucket_rows(rows) for rows in regions.tower_calls)


def census_forward_step(census, regions: Regions):
    """qvl's forward step with the region kept: "other" for the inputs, "loss" for the loss function."""
    from qvl.training.step import forward_step

    def step(state, data_iterator, model, return_schedule_plan: bool = False, *, loss_check=None):
        regions.set("other")
        output, loss_func = forward_step(state, data_iterator, model, loss_check=loss_check)

        def loss(*args, **kwargs):
            regions.set("loss")
            return loss_func(*args, **kwargs)

        return output, loss

    return step


def marked(batches, census):
    """The loader: each micro-batch's tensors (and those of its tower inputs) are host tensors."""
    for batch in batches:
        for value in (getattr(batch, f.name) for f in dataclasses.fields(batch)):
            if dataclasses.is_dataclass(value):  # TowerInputs
                value = [getattr(value, f.name) for f in dataclasses.fields(value)]
            census.mark_host(value)
        yield batch


def _tensors(tree) -> list[torch.Tensor]:
    """Tensors among `tree`'s leaves and the fields of its dataclass leaves (PackedSeqParams)."""
    tensors = []
    for leaf in pytree.tree_leaves(tree):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = (getattr(leaf, f.name) for f in dataclasses.fields(leaf))
            tensors += [value for value in fields if isinstance(value, torch.Tensor)]
        elif isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
    return tensors
