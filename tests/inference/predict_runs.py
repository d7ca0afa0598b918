"""Scenario ``inference.predict`` (tests/helpers/harness.py): evaluation-only runs under stage 3 (issue #31).

For each model (examples/gpt.py's GPT, an HF Llama from a tiny config) and each place of the partitions
('none': the device, 'cpu': host memory, 'nvme': swap files) one Trainer runs ``predict``, ``validate``
and ``test`` without ``fit`` under ``ZeroStrategy(stage=3, ...)`` on every rank; each rank records, per
run, the largest difference of every output from the plain model's on the same batch (the plain model
is built from the same seed in each process), what the engines hold (no optimizer, no state, no
trainable groups, partitions of half the model) and whether ``configure_optimizers`` ran. Extra runs
(params ``generate``) call :func:`lightning_zero.inference.generate` in ``predict_step`` and record its
tokens next to HF's greedy ``generate`` and the plain model's; ``fit_after`` trains one step after the
evaluation-only run, on the same module.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings
from typing import Any

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402

VOCAB, SEQ, SAMPLES, BATCH = 48, 12, 8, 2


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model, the same in every process for a seed."""
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          initializer_range=0.2)  # logits far apart: greedy tokens are no near-tie
        model = LlamaForCausalLM(cfg)
        model.generation_config.eos_token_id = None  # generate the requested number of tokens
        model.generation_config.pad_token_id = 0
        return model.eval()
    from examples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=3, n_head=4, d_model=32, seq_len=64)).eval()
    with torch.no_grad():  # weights larger than GPT-2's init: logits far apart, greedy tokens are no near-tie
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def hf_generate(model: torch.nn.Module, prompt: torch.Tensor, tokens: int, use_cache: bool = True) -> torch.Tensor:
    """HF's greedy decoding; the mask given (HF would mask every token equal to the pad id otherwise)."""
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False,
                          use_cache=use_cache)


def logits_of(kind: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits if kind == "llama" else model(x)


class EvalModule(pl.LightningModule):
    """Every evaluation step returns (or keeps) the model's logits next to its inputs; configure_optimizers
    returns an optimizer but must not be called by a run that only evaluates."""

    def __init__(self, kind: str, generate: int = 0, eos: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.model = build(kind)
        self.gen_tokens = generate
        self.eos = eos
        self.outputs: dict[str, list] = {"val": [], "test": []}
        self.optimizers_built = 0

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0]
        if self.gen_tokens:
            from lightning_zero.inference import generate

            prompt = x[:, :6]
            if self.eos:  # rank 0's row ends at its first token, rank 1's never: the ranks must keep in step
                prompt = prompt[:1]
                first = int(generate(self.model, prompt, 1)[0, -1])
                eos = first if self.global_rank == 0 else VOCAB + 1
                return {"prompt": prompt, "eos": eos, "ended": generate(self.model, prompt, self.gen_tokens,
                                                                        eos_token_id=eos, pad_token_id=0)}
            out = {"prompt": prompt,
                   "cached": generate(self.model, prompt, self.gen_tokens),
                   "uncached": generate(self.model, prompt, self.gen_tokens, use_cache=False)}
            if self.kind == "llama":  # HF's own greedy decoding, on the gathered weights
                with self.trainer.strategy.gathered_params(self.model):
                    out["hf"] = hf_generate(self.model, prompt, self.gen_tokens)
            return out
        return x, logits_of(self.kind, self.model, x)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.outputs["val"].append((batch[0], logits_of(self.kind, self.model, batch[0])))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.outputs["test"].append((batch[0], logits_of(self.kind, self.model, batch[0])))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = logits_of(self.kind, self.model, batch[0])
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[0][:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizers_built += 1
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)), batch_size=BATCH)


def strategy_options(where: str) -> dict[str, Any]:
    if where == "none":
        return {}
    opts: dict[str, Any] = {"offload_optimizer": where, "offload_params": where}
    if where == "nvme":
        path = tempfile.mkdtemp(prefix="lz_infer_nvme_")
        atexit.register(shutil.rmtree, path, True)
        opts["nvme_path"] = path
    return opts


def trainer_for(where: str, max_steps: int = -1) -> pl.Trainer:
    """Stage 3 with the partitions on the device ('none'), in host memory or on NVMe; or 'zeroK' (K < 3)."""
    stage = int(where[4]) if where.startswith("zero") else 3
    options = {} if stage < 3 else {"param_persistence_threshold": 0, **strategy_options(where)}
    return pl.Trainer(accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]),
                      strategy=ZeroStrategy(stage=stage, **options), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      max_steps=max_steps, num_sanity_val_steps=0)


def max_diff(pairs: list, kind: str, plain: torch.nn.Module) -> float:
    """Largest |strategy - plain| over the logits of every (inputs, logits) pair."""
    worst = 0.0
    with torch.no_grad():
        for x, got in pairs:
            worst = max(worst, float((got.cpu() - logits_of(kind, plain, x.cpu())).abs().max()))
    return worst


def engine_facts(trainer: pl.Trainer) -> dict[str, Any]:
    """What the strategy's engines hold on this rank (counted on the tensors themselves)."""
    engines = trainer.strategy.engines
    facts: dict[str, Any] = {"engines": [type(e).__name__ for e in engines]}
    e = engines[0]
    facts["param_groups"] = len(e.optimizer.param_groups)
    facts["state_bytes"] = e.state_bytes()
    facts["trainable_groups"] = len(e.groups)
    facts["grad_buffers"] = sum(1 for fg in e.all_groups if fg.grad_shard is not None or fg.flat_grad is not None)
    facts["partition_numel"] = sum(fg.layout.shard_numel for fg in e.frozen_groups)
    facts["partition_storage_bytes"] = sum(fg.master.untyped_storage().nbytes() for fg in e.frozen_groups)
    facts["host_pool_bytes"] = e.host.allocated
    facts["max_live_units"] = e.max_live_units_seen
    facts["prefetch_units"] = e.prefetch_units
    module = trainer.lightning_module.model
    facts["model_numel"] = sum(p.numel() for p in module.parameters())
    facts["param_storage_bytes"] = storage_bytes(module.parameters())
    facts["swap_files"] = len(os.listdir(e.swap_dir())) if e.swap_dir() else 0
    return facts


def eval_run(kind: str, where: str) -> dict[str, Any]:
    module = EvalModule(kind)
    plain = build(kind)
    trainer = trainer_for(where)
    predictions = trainer.predict(module, loader())
    out = {"predict": max_diff(predictions, kind, plain), "batches": len(predictions)}
    out["after_predict"] = engine_facts(trainer)
    trainer.validate(module, loader(), verbose=False)
    trainer.test(module, loader(), verbose=False)
    out["val"] = max_diff(module.outputs["val"], kind, plain)
    out["test"] = max_diff(module.outputs["test"], kind, plain)
    out["val_batches"] = len(module.outputs["val"])
    out["optimizers_built"] = module.optimizers_built
    out["after_test"] = engine_facts(trainer)
    return out


class MetaEvalModule(EvalModule):
    """The model built in ``configure_model`` (on the meta device under stage 3: materialised unit by unit
    by the evaluation engine), its weights coming from the checkpoint only."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.model = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.kind, seed=7)
            self.built_on_meta = any(p.is_meta for p in self.model.parameters())


def ckpt_run(kind: str, where: str, out_dir: str, meta: bool = False) -> dict[str, Any]:
    """Save a checkpoint from an evaluation-only run (seed 0's weights), then predict with it on a module
    built from another seed (``meta``: built in configure_model): the checkpoint's weights reach every
    partition (host memory, swap files)."""
    path = os.path.join(out_dir, f"{kind}_{where}_{meta}.ckpt")
    first = trainer_for(where)
    first.predict(EvalModule(kind), loader())
    first.save_checkpoint(path)
    plain = build(kind)
    other: EvalModule = MetaEvalModule(kind) if meta else EvalModule(kind)
    out: dict[str, Any] = {}
    if not meta:
        other.model = build(kind, seed=7)
        out["before"] = max_diff([(x, logits_of(kind, other.model, x)) for (x,) in loader()], kind, plain)
    predictions = trainer_for(where).predict(other, loader(), ckpt_path=path)
    out["predict"] = max_diff(predictions, kind, plain)
    out["built_on_meta"] = getattr(other, "built_on_meta", False)
    return out


def fit_after_run(kind: str) -> dict[str, Any]:
    """Predict, then fit one step on the same module (the evaluation engine gives its weights back)."""
    module = EvalModule(kind)
    plain = build(kind)
    trainer = trainer_for("none", max_steps=1)
    before = max_diff(trainer.predict(module, loader()), kind, plain)
    trainer.fit(module, loader())
    engines = trainer.strategy.engines
    return {"predict": before, "engines": [type(e).__name__ for e in engines],
            "optimizer": type(engines[0].optimizer).__name__, "optimizers_built": module.optimizers_built,
            "steps": trainer.global_step}


def generate_run(kind: str, where: str, tokens: int, eos: bool = False) -> dict[str, Any]:
    module = EvalModule(kind, generate=tokens, eos=eos)
    plain = build(kind)
    results = trainer_for(where).predict(module, loader())
    from lightning_zero.inference import generate

    out = []
    with torch.no_grad():
        for r in results:
            prompt = r["prompt"].cpu()
            row = {k: v.cpu() if torch.is_tensor(v) else v for k, v in r.items()}
            if eos:
                row["plain_cached"] = generate(plain, prompt, tokens)
                out.append(row)
                continue
            row["plain_cached"] = generate(plain, prompt, tokens)
            row["plain_uncached"] = generate(plain, prompt, tokens, use_cache=False)
            if kind == "llama":
                row["plain_hf"] = hf_generate(plain, prompt, tokens)
                row["plain_hf_nocache"] = hf_generate(plain, prompt, tokens, use_cache=False)
            out.append(row)
    return {"rows": out}


def moq_export_run(kind: str, where: str, out_dir: str) -> dict[str, Any]:
    """MoQ at 8 bits for 2 steps under stage 3, exporting at the end of fit (a collective gather, rank 0
    writes); every rank loads the file into a freshly quantized model and compares its logits with the
    trained weights (gathered again) fake-quantized in a plain model."""
    from lightning_zero.inference import MoQ, fake_quantize, quantize_linears

    path = os.path.join(out_dir, f"moq_{kind}_{where}.pt")
    module = EvalModule(kind)
    trainer = trainer_for(where, max_steps=2)
    trainer.callbacks.append(MoQ({0: 8}, group_size=16, export_path=path))
    trainer.fit(module, loader())
    trained = {k[len("model."):]: v for k, v in trainer.strategy.full_state_dict().items()}
    reference = build(kind)
    reference.load_state_dict(trained)
    with torch.no_grad():
        for m in reference.modules():
            if type(m) is torch.nn.Linear:
                m.weight.copy_(fake_quantize(m.weight, 8, 16))
    loaded = build(kind)
    quantize_linears(loaded, bits=8, group_size=16)
    loaded.load_state_dict({k[len("model."):]: v for k, v in torch.load(path).items()})
    x = next(iter(loader()))[0]
    with torch.no_grad():
        return {"diff": float((logits_of(kind, loaded, x) - logits_of(kind, reference, x)).abs().max()),
                "moved": float((logits_of(kind, reference, x) - logits_of(kind, build(kind), x)).abs().max())}


@scenario("inference.predict")
def predict(ctx: ScenarioContext) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for spec in ctx.params["runs"]:
        what, kind, where = spec.split(":")
        if what == "eval":
            runs[spec] = eval_run(kind, where)
        elif what in ("ckpt", "ckpt_meta"):
            runs[spec] = ckpt_run(kind, where, str(ctx.out), meta=what == "ckpt_meta")
        elif what == "moq_export":
            runs[spec] = moq_export_run(kind, where, str(ctx.out))
        elif what == "fit_after":
            runs[spec] = fit_after_run(kind)
        elif what in ("generate", "generate_eos"):
            runs[spec] = generate_run(kind, where, int(ctx.params.get("tokens", 5)), eos=what == "generate_eos")
        ctx.record("partial", runs)
    return runs
