"""One configuration of ``benchmarks/tp.py`` in its own torchrun group: a model tensor-parallelized with
one plan under one strategy, timed as ``peers_worker.py`` times its peers.

Configurations ``<model>_<peer>``: model ``gpt`` (examples/gpt.py's GPT, ``--model`` preset, plan
:func:`lightning_zero.parallel.tp_plan_gpt`) or ``llama`` (HF ``LlamaForCausalLM`` with random weights,
``--llama`` preset of benchmarks/presets.py, plan :func:`lightning_zero.parallel.tp_plan_llama`); peer
``zero`` (``ZeroStrategy(stage=--stage, tensor_parallel=--tp)``: ZeRO over the dp ranks) or ``mps``
(Lightning's ``ModelParallelStrategy(data_parallel_size=devices/tp, tensor_parallel_size=tp)``, FSDP2's
``fully_shard`` over its data-parallel dim, as its docs pair them; see :func:`parallelize_network`). Both build the
network in ``configure_model`` straight on the GPU and apply the same plan there with the same
``parallelize`` call, so only the strategies differ. The tokens a rank records are its replica's
tokens / tp (the tp ranks of a replica share one batch), so peers_report's sum over ranks is the
number of distinct tokens trained.

    python benchmarks/tp_worker.py --config gpt_zero --model gpt_tiny --device cpu --devices 2 --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
from benchmarks import peers_worker as pw, records, timing  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import LightningModule  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

CONFIGS = tuple(f"{m}_{p}" for m in ("gpt", "llama") for p in ("zero", "mps"))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = pw.gpt_worker_parser(__doc__, CONFIGS)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides --devices)")
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage of the zero peer")
    p.add_argument("--llama", default="llama_8b", help="benchmarks/presets.py Llama preset")
    p.add_argument("--llama-layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--llama-seq", type=int, default=None, help="override the preset's sequence length")
    args = p.parse_args(argv)
    if args.devices % args.tp:
        p.error(f"--tp {args.tp} must divide --devices {args.devices}")
    args.profile = False
    return args


def build_strategy(args: argparse.Namespace) -> Any:
    if args.config.endswith("_zero"):
        import lightning_zero

        return lightning_zero.ZeroStrategy(stage=args.stage, tensor_parallel=args.tp)
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=args.devices // args.tp, tensor_parallel_size=args.tp)


def _tp_and_dp(mesh: Any) -> tuple[Any, Optional[Any]]:
    """(tp sub-mesh, dp sub-mesh or None): ours names them 'tp'/'dp', Lightning's 'tensor_parallel'/'data_parallel'."""
    names = mesh.mesh_dim_names
    if "tp" in names:
        return mesh["tp"], None  # ZeRO partitions over dp itself
    return mesh["tensor_parallel"], mesh["data_parallel"]


def parallelize_network(module: LightningModule, network: torch.nn.Module, plan_fn: Any, block_type: type) -> None:
    """The one plan, applied the same way under both strategies; then, under ModelParallelStrategy,
    FSDP2's ``fully_shard`` over its data-parallel dim, each block then the root (torchtitan's and
    Lightning's TP + FSDP2 recipe). Also at dp = 1: it makes every parameter a DTensor, which torch's
    fused AdamW needs (TP alone leaves embeddings, norms and head plain tensors, and fused AdamW refuses
    a mix of Tensor and DTensor); ZeroStrategy steps its own flat buffers and needs neither."""
    from lightning_zero.parallel import parallelize

    tp, dp = _tp_and_dp(module.device_mesh)
    parallelize(network, tp, plan_fn(network, tp))
    if dp is not None:
        from torch.distributed.fsdp import fully_shard

        for m in network.modules():
            if isinstance(m, block_type):
                fully_shard(m, mesh=dp)
        fully_shard(network, mesh=dp)


def gpt_module(args: argparse.Namespace, cfg: Any) -> LightningModule:
    from examples.gpt import GPT, Block, GPTModule

    from lightning_zero.parallel import tp_plan_gpt

    class TPGPTModule(GPTModule):
        """examples/gpt_module.py's GPTModule, its network built in configure_model on the GPU and parallelized."""

        def _build_model(self) -> Any:
            return None

        def configure_model(self) -> None:
            if getattr(self, "model", None) is not None:
                return
            with torch.device(self.trainer.strategy.root_device):
                network = GPT(self.config)
            parallelize_network(self, network, tp_plan_gpt, Block)
            self.model = network

    return TPGPTModule(cfg, fused=None if args.no_fused else True, max_steps=args.warmup + args.steps, pipeline=False)


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, self.vocab, (self.seq,), generator=g),)


class LlamaModule(LightningModule):
    """LlamaForCausalLM (random weights) built in configure_model on the GPU, tp_plan_llama applied."""

    def __init__(self, dims: dict[str, int], args: argparse.Namespace) -> None:
        super().__init__()
        self.dims, self.args = dims, args
        self.model: Optional[torch.nn.Module] = None
        h, i, layers, v, s = (dims[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "seq_len"))
        kv = h * dims["num_key_value_heads"] // dims["num_attention_heads"]
        self.n_params = layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h
        self.flops_per_token = 6 * self.n_params + 12 * layers * h * s  # the GPT rule: 6N + attention

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from benchmarks.lora_worker import llama_config
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from lightning_zero.parallel import tp_plan_llama

        with torch.device(self.trainer.strategy.root_device):
            network = LlamaForCausalLM(llama_config(self.dims))
        parallelize_network(self, network, tp_plan_llama, LlamaDecoderLayer)
        self.model = network

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=None if self.args.no_fused else True)

    def train_dataloader(self) -> DataLoader:
        """Lightning adds the DistributedSampler from the strategy's ``distributed_sampler_kwargs``: both
        strategies shard by data-parallel rank only (the tp ranks of a replica share its batch)."""
        replicas = self.trainer.world_size // self.args.tp
        n = (self.args.warmup + self.args.steps) * self.args.micro_batch * replicas
        return DataLoader(RandomTokens(n, self.dims["seq_len"], self.dims["vocab_size"]), batch_size=self.args.micro_batch)


def _fit(args: argparse.Namespace, strategy: Any) -> None:
    import lightning.pytorch as L

    from benchmarks.presets import llama_preset, model_preset

    L.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    timer = timing.StepTimer(args.warmup)
    trainer = pw.build_trainer(args, strategy, timer)
    if args.config.startswith("gpt"):
        from examples.data import TextDataModule
        from examples.gpt import GPTConfig

        cfg = GPTConfig(**model_preset(args.model))
        model: Any = gpt_module(args, cfg)
        n_params = pw.count_params(cfg)
        trainer.fit(model, datamodule=TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch))
    else:
        _, dims = llama_preset(args.llama, args.llama_layers, args.llama_seq)
        model = LlamaModule(dims, args)
        n_params = model.n_params
        trainer.fit(model)
    if len(timer.step_times) < args.steps:
        raise RuntimeError(f"only {len(timer.step_times)} of {args.steps} timed steps ran (too little data?)")
    record = pw.rank_record(args, trainer, model, timer, n_params)
    record.update(tokens_per_step_local=timer.tokens_per_step / args.tp, tp=args.tp, stage=args.stage)
    records.append_record(args.results_file, record)
    records._shutdown_process_group()


def run(args: argparse.Namespace) -> int:
    return records.run_as_row(args, lambda: build_strategy(args), lambda strategy: _fit(args, strategy))


def main(argv: Optional[list[str]] = None) -> int:
    return records.worker_main(argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
