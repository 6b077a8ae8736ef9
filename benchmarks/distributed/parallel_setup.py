"""What Accelerate 1.15 does not set up by itself for benchmarks/distributed/fsdp2_llama.py's rows
(and the GPU and CPU tests' workers that share them): FSDP2 and a ParallelismConfig on CPU processes,
a transformers model's tensor-parallel plan applied to a model built in place, and the parameters
such a plan leaves plain. Each function says which gap it fills and why.
"""

from __future__ import annotations


def fsdp_on_cpu(accelerator, plugin) -> None:
    """For the CPU tests: accelerate 1.15 turns FSDP on only for GPU-like distributed types
    (AcceleratorState: MULTI_GPU, ...) and would train these CPU processes with DDP; torch's
    fully_shard itself runs on CPU over gloo, so the state is switched to FSDP by hand, as
    AcceleratorState would have set it, PartialState's copy included (every later AcceleratorState(),
    such as the one prepare's AcceleratedOptimizer makes, copies PartialState's distributed_type
    back: get_state_dict would then not gather the FSDP2 shards)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    if getattr(accelerator, "fp8_plan", None) is not None:  # made for DDP: again, now that FSDP2 is on
        from fp8plug.recipe.plans import make_plan

        accelerator.fp8_plan = make_plan(accelerator.fp8_engine, accelerator._recipe_for_run(accelerator.fp8_recipe),
                                         accelerator.fp8_selection.device, auto_filter=True)


def tp_on_cpu(accelerator, config) -> None:
    """For the CPU tests: accelerate 1.15 refuses a ParallelismConfig on CPU processes
    (`_validate_accelerator`: DistributedType.MULTI_CPU), while DTensor and the tensor-parallel
    plan run over gloo; so the config and its mesh are set on the state by hand, as the
    Accelerator's constructor would have set them."""
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")


def tensor_parallel(model, mesh) -> None:
    """Shard the meta model as its transformers tp_plan says, on the `mesh` (1-D, the tp dimension),
    record tp_size where Accelerate reads it (`config.distributed_config`), and replicate_unsharded.

    The plan's Linear styles are applied with torch's parallelize_module (colwise, rowwise, the
    head's gathered output): the shards and collectives of `from_pretrained(tp_plan="auto")`, whose
    own helpers for a model built in place differ between transformers releases (5.24 has
    `_expand_parallel_plan`, 5.17 not). The embedding stays replicated: torch's row-sharded
    embedding output (`_MaskPartial`) does not compile (torch 2.13, CPU)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate())}
    plan = {name: styles[style]() for name, style in dict(model.tp_plan).items() if style in styles}
    parallelize_module(model, mesh, plan)
    model.config.distributed_config = {"tp_size": mesh.size()}
    replicate_unsharded(model, mesh)


def replicate_unsharded(model, mesh) -> None:
    """Make every parameter a tensor-parallel plan left plain (the norms) a Replicate DTensor on the
    tp `mesh`, which its module's forward reads as the local tensor (`to_local`, through which the
    gradient flows back): what Accelerate 1.15's `_prepare_tp` does under FSDP2 with transformers'
    `ReplicateParallel`, which transformers 5.17 and 5.24 do not have. `_prepare_tp` imports that
    name before it looks at any parameter, so ParallelismConfig(tp_size=N, dp_shard_size=M) cannot
    prepare any model there; with every parameter a DTensor it never uses the class, so a stand-in
    that refuses to be used is put where it imports it from. Tensor parallelism alone needs it too:
    on CUDA the optimizers' foreach and fused steps refuse a mix of DTensor and plain parameters
    (aten._foreach_mul_, H200, transformers 5.17). Local tensors rather than DTensor activations
    through the norm: compiled, a DTensor norm under FSDP2 + TP failed in bf16 too (torch 2.11 on
    H200s: an unhashable SymInt in the DTensor spec; torch 2.13 on the CPU: the partitioner's
    "Node ... was invalid, but is output"). Call it before prepare()."""
    import torch
    import transformers.integrations.tensor_parallel as hf_tp
    from torch.distributed.tensor import DTensor, Replicate

    if not hasattr(hf_tp, "ReplicateParallel"):
        class ReplicateParallel:  # imported, never used: every parameter is a DTensor already
            def prepare_module_tp(self, module, mesh):
                raise NotImplementedError("parallel_setup.replicate_unsharded: a parameter was left plain")

        hf_tp.ReplicateParallel = ReplicateParallel

    def on_local_parameters(module):
        forward = module.forward

        def local_forward(*args, **kwargs):
            replicated = dict(module._parameters)
            module._parameters.update({n: p.to_local() for n, p in replicated.items() if isinstance(p, DTensor)})
            try:
                return forward(*args, **kwargs)
            finally:
                module._parameters.update(replicated)

        module.forward = local_forward

    for module in list(model.modules()):
        plain = [(n, p) for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        for name, param in plain:
            module.register_parameter(name, torch.nn.Parameter(DTensor.from_local(param, mesh, [Replicate()],
                                                                                  run_check=False)))
        if plain:
            on_local_parameters(module)
