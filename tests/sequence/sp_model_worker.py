"""Scenario ``sequence.runs`` (tests/helpers/harness.py): HF causal LMs built from configs, unmodified, one
step under sequence parallelism (lightning_zero.sequence) against the same model on the whole sequence in one
process. Runs ``{NAME: SPEC}`` (``run_worker``), SPEC: ``impl=...`` runs sp_attn_worker.py's attention check in the same process group; otherwise model (llama|qwen2|mistral), scheme (auto|ulysses|ring), layout (zigzag|contiguous), packed (1: rows
hold several documents, position ids restart per document), window (mistral's sliding window).
Each rank records the relative error of its logits, of the loss (mean over the group) and of every
parameter gradient (averaged over the group, as data-parallel averaging does), or the error message of a
refused model, and the storage bytes of what enters attention (``AttentionInputs``) beside the one-process
run's. Rank 0 writes ``OUT/NAME.pt``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_zero.sequence import SequenceLayout  # noqa: E402
from lightning_zero.sequence.batch import shard_batch, sequence_loss  # noqa: E402
from lightning_zero.sequence.context import SequenceContext  # noqa: E402
from lightning_zero.sequence.hf import prepare_hf  # noqa: E402
from lightning_zero.sequence.hf import attention_modules  # noqa: E402
from tests.helpers.compare import tensor_rel  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.sequence.sp_attn_worker import run as run_attention  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.worker_io import run_specs, save_result  # noqa: E402

SEQ, BATCH, VOCAB = 32, 2, 64


def build(kind: str, window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                  attn_implementation="sdpa")
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common))
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**common))
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(sliding_window=window, **common))


def batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).repeat(BATCH, 1)
    if packed:  # documents of 11 + 21 tokens in row 0, 7 + 9 + 16 in row 1
        pos[0, 11:] = torch.arange(SEQ - 11)
        pos[1, 7:16] = torch.arange(9)
        pos[1, 16:] = torch.arange(SEQ - 16)
    return ids, pos


class AttentionInputs:
    """Storage bytes of what enters attention in a forward, summed over the layers: each attention module's
    hidden states and the outputs of its q, k and v projections."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.bytes = 0
        self.handles = []
        for module in attention_modules(model):
            self.handles.append(module.register_forward_pre_hook(self._hidden, with_kwargs=True))
            for proj in ("q_proj", "k_proj", "v_proj"):
                self.handles.append(getattr(module, proj).register_forward_hook(self._projection))

    def _hidden(self, module, args, kwargs) -> None:
        self.bytes += storage_bytes([args[0] if args else kwargs["hidden_states"]])

    def _projection(self, module, args, output) -> None:
        self.bytes += storage_bytes([output])

    def remove(self) -> int:
        for handle in self.handles:
            handle.remove()
        return self.bytes


def unpacked_reference(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of a packed batch: every document run on its own (the unpacked run); logits put back
    where its tokens sit, the loss the token mean over every document's own next-token targets."""
    logits = torch.zeros(ids.shape + (VOCAB,))
    total, count = torch.zeros(()), 0
    for b in range(ids.shape[0]):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for lo, hi in zip(starts[:-1], starts[1:]):
            doc_logits = model(input_ids=ids[b:b + 1, lo:hi]).logits[0]
            logits = logits.index_put((torch.tensor([b]), torch.arange(lo, hi)), doc_logits)
            total = total + torch.nn.functional.cross_entropy(doc_logits[:-1], ids[b, lo + 1:hi], reduction="sum")
            count += hi - lo - 1
    return logits, total / count


def run(name: str, spec: str, out: str) -> None:
    opts = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    if "impl" in opts:  # an attention-only run (sp_attn_worker.py): one launch serves both suites
        return run_attention(name, spec, out)
    n, r = dist.get_world_size(), dist.get_rank()
    kind, window = opts.get("model", "llama"), int(opts.get("window", 4096))
    packed = opts.get("packed") == "1"
    ids, pos = batch(packed)
    labels = ids.masked_fill(pos == 0, -100) if packed else ids  # as DataCollatorWithFlattening labels them

    ref_model = build(kind, window)
    ref_logits, ref_loss = unpacked_reference(ref_model, ids, pos) if packed else (None, None)
    ref_inputs = 0
    if not packed:
        counter = AttentionInputs(ref_model)
        out_ref = ref_model(input_ids=ids, labels=ids, position_ids=pos)
        ref_logits, ref_loss, ref_inputs = out_ref.logits, out_ref.loss, counter.remove()
    ref_loss.backward()

    model = build(kind, window)
    layout = SequenceLayout(SEQ, n, opts.get("layout", "zigzag"))
    context = SequenceContext(None, layout, opts.get("scheme", "auto"))
    shard = shard_batch(ids, labels, layout, r, position_ids=pos)
    context.doc = shard.doc
    counter = AttentionInputs(model)
    try:  # what the model cannot split is refused at setup or at the first attention call
        prepare_hf(model, context)
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    except ValueError as err:
        save_result({"spec": spec}, {"error": str(err)}, out, name)
        return
    loss = sequence_loss(logits, shard.shift_labels, None)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    errors = {"logits": tensor_rel(logits.detach(), layout.shard(ref_logits.detach(), r)),
              "loss": abs(float(mean_loss) / n - float(ref_loss)) / float(ref_loss)}
    worst = 0.0
    for (pname, p), q in zip(model.named_parameters(), ref_model.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, tensor_rel(grad / n, q.grad))
    errors["grads"] = worst
    save_result({"spec": spec}, {"errors": errors, "packed_docs": shard.doc is not None,
                                 "attn": model.config._attn_implementation,
                                 "attn_inputs": (counter.remove(), ref_inputs)}, out, name)



@scenario("sequence.runs")
def runs(ctx: ScenarioContext) -> None:
    dist.init_process_group("gloo")
    try:
        run_specs(run, ctx)
    finally:
        dist.destroy_process_group()
