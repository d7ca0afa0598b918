"""PipelineModule on one process: sequential semantics, lazy per-stage construction, seeds, names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from lightning_zero.pipeline import microbatch as mbu
from lightning_zero.pipeline.module import find_pipeline_modules
from tests.pipeline.pipe_model import DIM, SEQ, VOCAB, head, layer_specs, token_loss


class Logged(nn.Linear):
    """A Linear that records where it was built."""

    def __init__(self, log: list, tag: int) -> None:
        super().__init__(DIM, DIM)
        log.append((tag, self.weight.device.type))


def _batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, torch.roll(x, 1, dims=1)


def test_unpipelined_call_runs_layers_in_sequence() -> None:
    torch.manual_seed(0)
    pipe = PipelineModule(layer_specs(2), token_loss)
    x, y = _batch()
    emb = pipe.tied["embed"]
    h = emb(x)
    for i in (1, 2, 3):
        h = pipe.layers[str(i)](h)
    expected = token_loss(head(emb, h), y)
    loss = pipe((x, y))
    assert loss.requires_grad and torch.allclose(loss, expected)
    assert torch.allclose(pipe.predict(x), head(emb, h))
    loss.backward()  # one shared embedding, gradient from both uses
    assert emb.weight.grad is not None and len(list(pipe.parameters())) == len(set(pipe.parameters()))


def test_construction_is_lazy_and_a_stage_builds_only_its_layers() -> None:
    log: list = []
    pipe = PipelineModule([LayerSpec(Logged, log, i) for i in range(6)], partition="uniform")
    assert log == [] and not pipe.is_materialized
    pipe.materialize(stage=1, num_stages=2)
    assert log == [(3, "cpu"), (4, "cpu"), (5, "cpu")]
    assert sorted(pipe.layers.keys()) == ["3", "4", "5"]


def test_counting_parameters_builds_on_meta() -> None:
    log: list = []
    pipe = PipelineModule([LayerSpec(Logged, log, i) for i in range(4)])  # partition='parameters'
    pipe.materialize(stage=0, num_stages=2)
    assert [t for t in log if t[1] == "cpu"] == [(0, "cpu"), (1, "cpu")]
    assert all(device == "meta" for _, device in log if _ >= 2)


def test_any_access_builds_everything_when_not_placed() -> None:
    pipe = PipelineModule(layer_specs(2), token_loss)
    assert len(list(pipe.parameters())) > 0 and pipe.placement is not None and pipe.placement.num_stages == 1
    pipe2 = PipelineModule(layer_specs(2), token_loss)
    assert len(pipe2.state_dict()) > 0
    pipe3 = PipelineModule(layer_specs(2), token_loss)
    found = find_pipeline_modules(nn.ModuleDict({"a": nn.Sequential(pipe3)}))  # finding does not build
    assert [n for n, _ in found] == ["a.0"] and not pipe3.is_materialized


def test_stage_weights_equal_the_whole_model_weights() -> None:
    torch.manual_seed(7)
    whole = PipelineModule(layer_specs(4), token_loss)
    torch.manual_seed(7)
    stage = PipelineModule(layer_specs(4), token_loss)
    stage.materialize(stage=1, num_stages=2)
    full, part = whole.state_dict(), stage.state_dict()
    assert set(part) < set(full)
    for k, v in part.items():
        assert torch.equal(v, full[k]), k
    assert "tied.embed.weight" in part  # the head's stage holds a copy of the embedding


def test_state_dicts_cross_between_stage_and_whole_model() -> None:
    whole = PipelineModule(layer_specs(4), token_loss)
    stage = PipelineModule(layer_specs(4), token_loss, seed_layers=False)
    stage.materialize(stage=0, num_stages=2)
    stage.load_state_dict(whole.state_dict(), strict=True)  # other stages' layers are skipped
    for k, v in stage.state_dict().items():
        assert torch.equal(v, whole.state_dict()[k])
    result = PipelineModule(layer_specs(4), token_loss).load_state_dict(stage.state_dict(), strict=False)
    assert result.missing_keys and not result.unexpected_keys
    with pytest.raises(RuntimeError, match="Unexpected key"):
        stage.load_state_dict({**whole.state_dict(), "layers.99.weight": torch.zeros(1)}, strict=True)


def test_placement_rules() -> None:
    pipe = PipelineModule(layer_specs(4), token_loss)
    list(pipe.parameters())  # built whole
    pipe.materialize(stage=1, num_stages=2)  # narrowing a whole module is allowed
    assert "1" not in pipe.layers and "5" in pipe.layers
    pipe.materialize(stage=1, num_stages=2)  # idempotent
    with pytest.raises(RuntimeError, match="cannot be re-placed"):
        pipe.materialize(stage=0, num_stages=2)
    with pytest.raises(ValueError, match="7 layer\\(s\\) but the pipeline has 8 stage\\(s\\)"):
        PipelineModule(layer_specs(4), token_loss).materialize(stage=0, num_stages=8)


def test_interleaved_placement_holds_chunks() -> None:
    pipe = PipelineModule(layer_specs(6), token_loss, partition="uniform")  # 9 layers, 4 parts
    pipe.materialize(stage=0, num_stages=2, chunks=2)
    assert pipe.placement.local_parts == [0, 2]
    held = sorted(int(k) for k in pipe.layers.keys())
    assert held == list(pipe.placement.layers_of(0))[1:] + list(pipe.placement.layers_of(2))  # layer 0 is tied
    assert pipe.tied_holders() == {"embed": [0, 1]}


def test_plain_modules_and_functions_as_layers() -> None:
    lin = nn.Linear(DIM, DIM)
    pipe = PipelineModule([lin, torch.tanh, LayerSpec(nn.Linear, DIM, 1)], lambda out, y: F.mse_loss(out, y))
    x, y = torch.randn(3, DIM), torch.randn(3, 1)
    assert torch.allclose(pipe((x, y)), F.mse_loss(pipe.layers["2"](torch.tanh(lin(x))), y))
    assert pipe.layers["0"] is lin


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    grads = []
    for interval in (0, 2):
        torch.manual_seed(3)
        pipe = PipelineModule(layer_specs(3), token_loss, activation_checkpoint_interval=interval)
        pipe(_batch()).backward()
        grads.append([p.grad.clone() for p in pipe.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


def test_recomputed_segments_fold_batch_norm_statistics_in_once() -> None:
    """activations/recompute.py [Note: buffers in a recomputed region] for the pipeline's own
    checkpointing: a CNN's batch norms recomputed in backward keep the statistics of the run without
    recomputation, bit for bit (LayerSpec-built blocks and a plain module alike)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn(self.conv(x))) + x

    states = []
    for interval in (0, 2):
        torch.manual_seed(0)
        pipe = PipelineModule([nn.Conv2d(3, 4, 3, padding=1), LayerSpec(Block), Block(), nn.Flatten(),
                               nn.Linear(4 * 36, 2)], lambda out, y: F.mse_loss(out, y),
                              activation_checkpoint_interval=interval)
        x, y = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 2)
        pipe((x, y)).backward()
        states.append({k: v.clone() for k, v in pipe.state_dict().items()})
    assert int(states[1]["layers.1.bn.num_batches_tracked"]) == 1
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_bad_calls() -> None:
    pipe = PipelineModule(layer_specs(1))
    with pytest.raises(TypeError, match="batch=\\(inputs, labels\\)"):
        pipe(torch.zeros(2, SEQ, dtype=torch.long))
    with pytest.raises(ValueError, match="loss_fn=None"):
        pipe(_batch())
    with pytest.raises(ValueError, match="without '.'"):
        TiedLayerSpec("a.b", nn.Linear, 2, 2)
    with pytest.raises(TypeError, match="not a LayerSpec"):
        PipelineModule([3])


def test_microbatch_split_and_metadata() -> None:
    x, y = _batch(6)
    ins, lbs, sizes = mbu.split_batch(x, y, 4, strict=False)
    assert sizes == [2, 2, 1, 1] and torch.equal(torch.cat(ins), x) and torch.equal(torch.cat(lbs), y)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by microbatches=4"):
        mbu.split_batch(x, y, 4, strict=True)
    act = (torch.randn(2, 3, 5, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bool))
    meta = mbu.describe(*mbu.flatten(act, "test"))
    assert mbu.decode(mbu.encode(meta, torch.device("cpu"))) == meta
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        mbu.flatten({"a": act[0]}, "layer 3")


def test_config_rejects_bad_pipeline_options() -> None:
    with pytest.raises(ValueError, match="ZeRO stage 2 cannot be combined with pipeline_stages=2"):
        ZeroStrategy(stage=2, pipeline_stages=2)
    with pytest.raises(ValueError, match="ZeRO stage 3 cannot be combined"):
        ZeroStrategy(stage=3, pipeline_stages=2)
    with pytest.raises(ValueError, match="schedule must be one of \\['1f1b', 'gpipe', 'interleaved'\\]"):
        ZeroStrategy(stage=1, pipeline_stages=2, schedule="zigzag")
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1"):
        ZeroStrategy(stage=1, pipeline_stages=2, microbatches=0)
    with pytest.raises(ValueError, match="multiple of pipeline_stages"):
        ZeroStrategy(stage=1, pipeline_stages=2, schedule="interleaved", microbatches=3)
    ZeroStrategy(stage=2, microbatches=8)  # pipeline options alone are harmless


def test_pipeline_preset_is_registered() -> None:
    from lightning.pytorch import Trainer

    trainer = Trainer(strategy="pipeline", accelerator="cpu", devices=2, logger=False)
    cfg = trainer.strategy.config
    assert (cfg.stage, cfg.pipeline_stages, cfg.schedule) == (1, 2, "1f1b")
