"""FP8 linears (issue #33 item 1), one process: the converted Linear's forward and backward against a pure-torch
float8 quantize-dequantize reference, what the conversion keeps (the user's Parameters, the state-dict names
and values, in both directions), which Linears it picks, and the one-line refusals.

[Note: the bounds of the numerics test]
torchao's emulated float8 (``emulate=True``: what runs on CPU) casts exactly as on a GPU and multiplies the
dequantized operands in fp32 (torchao/float8/float8_ops.py), returning bf16. The reference below does the same
with its own code: per-tensor scale ``fmax / amax`` (in float64, then fp32; rowwise: per row, rounded down to a
power of two), clamp, cast to ``float8_e4m3fn`` (``e5m2`` for tensorwise's output gradient), divide back,
fp32 matmul. The two must agree to bf16's rounding of the output (2**-8 relative; 2**-7 allowed for the
matmul's summation order), and both must differ from the bf16 matmul by what float8 loses: e4m3 keeps 3
mantissa bits (a relative error up to 2**-4 per operand, so about 0.13 per product at worst, far less on
average): each result within 0.15 of ``|x| @ |w|^T`` of the exact one, and not equal to it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zero.config import Fp8Config, ZeroConfig
from lightning_zero.quant import fp8

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def qdq(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, pow2: bool = False) -> torch.Tensor:
    """``t`` cast to float8 with a dynamic scale (one per tensor, or per slice along ``dim``) and back, in fp32."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def _cfg(recipe: str = "tensorwise", **kw: object) -> Fp8Config:
    return Fp8Config(fp8=recipe, fp8_emulate=True, **kw)


def _pair(recipe: str, seed: int = 0) -> tuple[nn.Linear, nn.Module]:
    """A bf16 Linear (64 -> 48) and its fp8 copy (same values), converted by quant/fp8.py's own path."""
    torch.manual_seed(seed)
    plain = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    holder = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 48), nn.Linear(48, 16)).to(torch.bfloat16)
    holder[1].load_state_dict(plain.state_dict())
    fp8.convert(holder, _cfg(recipe), torch.device("cpu"), "bf16-mixed", info=lambda m: None)
    assert type(holder[1]).__name__ == "Float8Linear"
    return plain, holder[1]


def _inputs(seed: int = 1, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 64, generator=g) * torch.logspace(-1, 1, 64)).to(torch.bfloat16)  # uneven columns
    go = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
    return x, go


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 2**-7, atol: float = 1e-6) -> bool:
    return bool(((got.float() - ref.float()).abs() <= rel * ref.float().abs() + atol).all())


def test_tensorwise_forward_and_backward_match_the_reference() -> None:
    plain, f8 = _pair("tensorwise")
    x, go = _inputs()
    xa = x.clone().requires_grad_(True)
    y = f8(xa)
    y.backward(go)
    w = plain.weight.detach()
    y_ref = (qdq(x, E4M3) @ qdq(w, E4M3).t()).to(torch.bfloat16) + plain.bias.detach()  # bias added in bf16
    gx_ref = qdq(go, E5M2) @ qdq(w, E4M3)
    gw_ref = qdq(go, E5M2).t() @ qdq(x, E4M3)
    assert y.dtype == torch.bfloat16 and _close(y, y_ref)
    assert _close(xa.grad, gx_ref.to(torch.bfloat16)) and _close(f8.weight.grad, gw_ref.to(torch.bfloat16))
    assert torch.equal(f8.bias.grad, go.float().sum(0).to(torch.bfloat16))  # the bias is outside the fp8 GEMM
    # against the bf16 matmul: changed (fp8 happened), within what e4m3 loses per product
    y_hp = x.float() @ w.float().t() + plain.bias.float()
    bound = 0.15 * (x.float().abs() @ w.float().abs().t())
    assert not torch.equal(y.float(), y_hp.to(torch.bfloat16).float())
    assert bool(((y.float() - y_hp).abs() <= bound + 1e-2).all())


def test_rowwise_forward_matches_the_reference_and_backward_stays_within_fp8s_loss() -> None:
    plain, f8 = _pair("rowwise")
    x, go = _inputs(2)
    xa = x.clone().requires_grad_(True)
    y = f8(xa)
    y.backward(go)
    w = plain.weight.detach()
    y_ref = (qdq(x, E4M3, dim=-1, pow2=True) @ qdq(w, E4M3, dim=-1, pow2=True).t()).to(torch.bfloat16)
    assert _close(y, y_ref + plain.bias.detach())
    gx_hp, gw_hp = go.float() @ w.float(), go.float().t() @ x.float()
    for got, hp, scale in ((xa.grad, gx_hp, go.float().abs() @ w.float().abs()),
                           (f8.weight.grad, gw_hp, go.float().abs().t() @ x.float().abs())):
        assert not torch.equal(got.float(), hp.to(torch.bfloat16).float())
        assert bool(((got.float() - hp).abs() <= 0.15 * scale + 1e-2).all())


def test_conversion_keeps_the_parameters_and_the_state_dict_both_ways() -> None:
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, tie_weights=False)
    torch.manual_seed(0)
    net = GPT(cfg)
    before = {n: p for n, p in net.named_parameters()}
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    plan = fp8.convert(net, _cfg(), torch.device("cpu"), "bf16-mixed", info=lambda m: None)
    assert plan is not None and len(plan.converted) == 7 and plan.kept == ["blocks.0.attn.qkv", "lm_head"]
    after = dict(net.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)  # the same objects
    assert list(net.state_dict()) == list(sd) and all(torch.equal(net.state_dict()[k], sd[k]) for k in sd)
    plain = GPT(cfg)  # other values: an fp8 model's state dict loads into a plain one, strictly...
    plain.load_state_dict(net.state_dict())
    assert all(torch.equal(plain.state_dict()[k], sd[k]) for k in sd)
    torch.manual_seed(5)
    other = GPT(cfg)
    net.load_state_dict(other.state_dict())  # ...and a plain one's into the fp8 model
    assert all(torch.equal(net.state_dict()[k], v) for k, v in other.state_dict().items())


def test_filter_names_first_last_and_idempotence() -> None:
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    msgs: list[str] = []
    plan = fp8.convert(net, _cfg(fp8_filter="2"), torch.device("cpu"), "bf16-mixed", info=msgs.append)
    assert plan is not None and plan.converted == ["1", "3"] and plan.kept == ["0", "2", "4"]
    assert msgs == ["fp8='tensorwise' (emulated: float8 casts, matmuls in higher precision): 2 Linear(s) compute "
                    "in float8, 3 kept in bf16: 0, 2, 4"]
    converted = [net[1], net[3]]
    again = fp8.convert(net, _cfg(fp8_filter="2"), torch.device("cpu"), "bf16-mixed", info=msgs.append)
    assert again == plan and [net[1], net[3]] == converted and len(msgs) == 1  # a second setup: left as it is
    every = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    fp8.convert(every, _cfg(fp8_keep_first_last=False), torch.device("cpu"), "bf16-mixed", info=lambda m: None)
    assert all(type(m).__name__ == "Float8Linear" for m in every)


def test_refusals_say_why_in_one_line() -> None:
    cpu = torch.device("cpu")
    net = lambda: nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))  # noqa: E731
    with pytest.raises(ValueError, match="needs precision='bf16-mixed'"):
        fp8.convert(net(), _cfg(), cpu, "32-true")
    with pytest.raises(ValueError, match="needs precision='bf16-mixed'"):
        fp8.convert(net(), _cfg(), cpu, "16-mixed")
    with pytest.raises(RuntimeError, match="compute capability >= 8.9.*fp8_emulate=True"):
        fp8.convert(net(), Fp8Config(fp8="tensorwise"), cpu, "bf16-mixed")
    odd = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 40), nn.Linear(40, 32))
    odd.insert(2, nn.Linear(40, 40))
    with pytest.raises(ValueError, match=r"divisible by 16; not so for 1 \(32x40\), 2 \(40x40\).*fp8_filter"):
        fp8.convert(odd, _cfg(), cpu, "bf16-mixed")
    done = net()
    fp8.convert(done, _cfg(fp8_keep_first_last=False), cpu, "bf16-mixed", info=lambda m: None)
    for m in done:
        delattr(m, fp8.MARK)  # as if the user had converted it with torchao
    with pytest.raises(ValueError, match="Float8Linear already"):
        fp8.convert(done, _cfg(), cpu, "bf16-mixed")
    quantized = net()
    quantized[1].weight = nn.Parameter(torch.zeros(32, 32, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="'1' is quantized already"):
        fp8.convert(quantized, _cfg(), cpu, "bf16-mixed")
    hooked = net()
    hooked[1].register_forward_hook(lambda mod, args, out: out)
    torch.nn.utils.parametrizations.weight_norm(hooked[2])
    with pytest.raises(ValueError, match=r"would drop what is attached to 1 \(forward_hooks\), 2 \(parametrizations\)"):
        fp8.convert(hooked, _cfg(fp8_keep_first_last=False), cpu, "bf16-mixed")
    with pytest.raises(ValueError, match="would convert no Linear"):
        fp8.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), _cfg(), cpu, "bf16-mixed")
    assert fp8.convert(net(), Fp8Config(), cpu, "32-true") is None  # off: nothing checked, nothing done


def test_config_validates_and_refuses_what_is_not_built() -> None:
    assert Fp8Config(fp8="RowWise").fp8 == "rowwise" and Fp8Config(fp8="none").fp8 is None
    assert Fp8Config(fp8_filter="head").fp8_filter == ["head"] and Fp8Config(fp8_filter=[]).fp8_filter is None
    with pytest.raises(ValueError, match=r"fp8 must be None or one of \['tensorwise', 'rowwise'\]"):
        Fp8Config(fp8="e4m3")
    with pytest.raises(ValueError, match="fp8_filter must be a list"):
        Fp8Config(fp8="tensorwise", fp8_filter=[3])
    with pytest.raises(ValueError, match="fp8_emulate must be True or False"):
        Fp8Config(fp8_emulate="yes")
    for name in ("tensor_parallel", "pipeline_stages", "expert_parallel", "sequence_parallel"):
        extra = {"stage": 1} if name == "pipeline_stages" else {}
        with pytest.raises(ValueError, match=f"fp8='tensorwise' with {name}=2 is not built yet"):
            ZeroConfig(fp8="tensorwise", **{name: 2}, **extra)
    assert ZeroConfig(stage=3, fp8="rowwise").piece(Fp8Config).fp8 == "rowwise"


def test_the_strategy_refuses_fp32_at_setup() -> None:
    """Through the real front door (Fabric, one process): the precision check runs where the module is set up."""
    from lightning.fabric import Fabric

    import lightning_zero

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true",
                    strategy=lightning_zero.ZeroFabricStrategy(stage=2, fp8="tensorwise", fp8_emulate=True))
    fabric.launch()
    with pytest.raises(ValueError, match="fp8 needs precision='bf16-mixed'"):
        fabric.setup(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)))


def test_a_setup_refusal_under_zero3_is_the_error_the_user_sees(tmp_path: Path) -> None:
    """Trainer front door, model built on the meta device in configure_model: fp8 without an fp8 GPU is refused at
    setup, and that refusal (not Lightning's teardown failing to move meta tensors to the CPU) is what is raised."""
    import lightning.pytorch as pl

    import lightning_zero

    class Tiny(pl.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "net"):
                self.net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         strategy=lightning_zero.ZeroStrategy(stage=3, fp8="tensorwise"))
    data = torch.utils.data.DataLoader(torch.randn(4, 32), batch_size=2)
    with pytest.raises(RuntimeError, match="compute capability >= 8.9"):
        trainer.fit(Tiny(), data)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with compute capability >= 8.9")
def test_real_float8_on_the_gpu_matches_the_reference() -> None:
    """On a GPU with fp8, the ``torch._scaled_mm`` path (not emulated) against the reference."""
    dev = torch.device("cuda")
    holder = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 48), nn.Linear(48, 16)).to(dev, torch.bfloat16)
    w = holder[1].weight.detach().clone()
    fp8.convert(holder, Fp8Config(fp8="tensorwise"), dev, "bf16-mixed", info=lambda m: None)
    x, go = (t.to(dev) for t in _inputs(rows=16))  # real float8 trains on rows in sixteens (refused otherwise)
    y = holder[1](x.clone().requires_grad_(True))
    y_ref = (qdq(x, E4M3) @ qdq(w, E4M3).t()).to(torch.bfloat16) + holder[1].bias.detach()
    # _scaled_mm adds the bias before its one rounding to bf16, the reference after: an output that cancels
    # to near zero differs by a bf16 step of its terms, not of itself, so the slack is one step of the largest
    assert _close(y, y_ref, rel=2**-6, atol=2**-7 * float(y_ref.float().abs().max()))


def test_a_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9 .*NVIDIA A100 has 8.0"):
        fp8.check_device(torch.device("cuda", 0), emulate=False)
    fp8.check_device(torch.device("cuda", 0), emulate=True)  # emulated: any device


def test_real_float8_refuses_a_training_row_count_its_weight_gradient_cannot_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: float8 weight gradients need rows in sixteens]: the weight-gradient GEMM contracts over the
    micro-batch's rows, so a row count that is not a multiple of 16 is refused at the forward (naming the
    Linear), also for a frozen Linear that backward runs through; emulation has no such limit and no check."""
    monkeypatch.setattr(fp8, "check_device", lambda device, emulate: None)  # real float8 on this CPU, as on a GPU
    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)).to(torch.bfloat16)
    fp8.convert(net, Fp8Config(fp8="tensorwise"), torch.device("cpu"), "bf16-mixed", info=lambda m: None)
    x = torch.randn(3, 4, 32, dtype=torch.bfloat16)  # 12 rows (tokens)
    with pytest.raises(ValueError, match=r"Linear '1' got 12 rows .*multiple of 16.*pad_to_multiple_of=16"):
        net(x)
    with torch.no_grad():
        assert net(x).shape == (3, 4, 32)  # no backward (validation, generation): any row count
    net[1].weight.requires_grad_(False)  # frozen (a LoRA base) ...
    assert net[1](x).shape == (3, 4, 32)  # ... with nothing to differentiate: no backward through it
    with pytest.raises(ValueError, match="Linear '1' got 12 rows"):
        net[1](x.clone().requires_grad_())  # ... with a gradient flowing through it
    emulated = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)).to(torch.bfloat16)
    fp8.convert(emulated, _cfg(), torch.device("cpu"), "bf16-mixed", info=lambda m: None)
    assert emulated(x).shape == (3, 4, 32)  # emulated: fp32 matmuls take any row count


def test_hydra_override_and_the_trainer_front_door(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``strategy.fp8=...`` composes into the strategy; under the Trainer the model is converted at setup, trains,
    and a validate after fit (Lightning sets the strategy up again) keeps the same Float8Linears."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    import lightning.pytorch as pl

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "examples"))
    import train  # noqa: F401  (registers the schemas)

    with initialize_config_dir(version_base="1.3", config_dir=str(root / "conf")):
        cfg = compose(config_name="config", overrides=[f"run_dir={tmp_path}", "strategy=zero2", "strategy.fp8=rowwise",
                                                       "strategy.fp8_filter=[head]", "strategy.fp8_emulate=true"])
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert (strategy.config.fp8, strategy.config.fp8_filter, strategy.config.fp8_emulate) == ("rowwise", ["head"], True)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))

        def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
            return self.body(batch).float().pow(2).mean()

        def validation_step(self, batch: torch.Tensor, idx: int) -> None:
            self.log("val", self.body(batch).float().pow(2).mean())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    import lightning_zero

    data = torch.utils.data.DataLoader(torch.randn(8, 16), batch_size=4)
    net = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=lightning_zero.ZeroStrategy(stage=2, fp8="tensorwise", fp8_emulate=True))
    before = net.body[1].weight.detach().clone()
    with caplog.at_level(logging.INFO):
        trainer.fit(net, data, data)
    assert "2 Linear(s) compute in float8, 2 kept in bf16: body.0, body.3" in caplog.text  # visible in the log
    converted = [type(m).__name__ for m in net.body]
    assert converted == ["Linear", "Float8Linear", "Float8Linear", "Linear"]
    assert not torch.equal(net.body[1].weight.detach().float(), before.float())  # it trained
    mods = list(net.body)
    trainer.validate(net, data)
    assert list(net.body) == mods


def _fit(accelerator: str = "cpu", precision: str = "bf16-mixed", steps: int = 3,
         **strategy: object) -> tuple[list[float], int]:
    """The example GPT under ZeroFabricStrategy(**strategy) on one device: the losses of ``steps`` AdamW steps on
    one batch, and the calls dynamo captured."""
    from gpt import GPT, GPTConfig
    from lightning.fabric import Fabric

    import lightning_zero

    fabric = Fabric(accelerator=accelerator, devices=1, precision=precision,
                    strategy=lightning_zero.ZeroFabricStrategy(**strategy))
    fabric.launch()
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16))
    net, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1)).to(fabric.device)
    torch._dynamo.utils.counters.clear()
    losses = []
    for _ in range(steps):  # stage 3 runs the first batch eagerly (zero/compile.py [Note: first batches run eagerly])
        loss = torch.nn.functional.cross_entropy(net(x[:, :-1]).reshape(-1, 64).float(), x[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, torch._dynamo.utils.counters["stats"]["calls_captured"]


def test_fp8_composes_with_compile_under_stage3() -> None:
    """``compile=True`` traces the units' Float8Linears whole (``fullgraph=True``; aot_eager: the graph
    without inductor's compile time, CI is CPU) and trains as the eager fp8 run does."""
    fp8_opts = {"stage": 3, "fp8": "tensorwise", "fp8_emulate": True, "param_persistence_threshold": 0}
    eager, captured = _fit(**fp8_opts)
    assert captured == 0
    compiled, captured = _fit(**fp8_opts, compile=True, compile_options={"backend": "aot_eager", "fullgraph": True})
    assert captured > 0
    assert max(abs(a - b) / b for a, b in zip(compiled, eager)) <= 1e-3, (compiled, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with compute capability >= 8.9")
def test_real_float8_under_zero3_and_compile_tracks_bf16_on_the_gpu() -> None:
    """The real path (``torch._scaled_mm``, inductor) under zero3: the loss within 1e-2 of bf16's at every step
    (the CPU runs' bound is 1e-3 over 4 steps: tests/quant/test_fp8_zero.py), and not equal to it."""
    bf16, _ = _fit("cuda", stage=3, param_persistence_threshold=0, compile=True)
    real, captured = _fit("cuda", stage=3, param_persistence_threshold=0, compile=True, fp8="tensorwise")
    assert captured > 0 and real != bf16
    assert max(abs(a - b) / b for a, b in zip(real, bf16)) <= 1e-2, (real, bf16)
