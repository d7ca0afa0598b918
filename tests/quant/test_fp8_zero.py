"""FP8 linears under zero1/zero2/zero3 (issue #33 item 1): the example GPT on 2 gloo ranks, one launch
(tests/quant/fp8_runs.py), bf16-mixed, AdamW at lr 3e-3, 4 steps, every run from the same weights on the same
batches; torchao's emulated float8 (the casts of a GPU run, the matmuls in higher precision) on CPU.

[Note: the bound the fp8 runs are held to]
fp8 changes the numerics, so there is no exact oracle: the fp8 run must *track* the same stage's bf16 run,
the global loss within 1e-3 (relative) at every step and all weights together within 0.04 after the last step
(``||W - W_bf16|| / ||W_bf16||``, all parameters as one vector). Measured (2026-11-28, torchao 0.18, torch 2.13
CPU): losses within 1.8e-4 (tensorwise) and 1.2e-4 (rowwise), weights within 0.017 and 0.014; for scale,
the bf16 run is 0.0053 from the fp32 run and its losses within 3.5e-5: the weight distance comes mostly from
Adam's first steps, ~``lr x sign(g)`` per element, which turn a gradient that fp8 moves across zero into an
update of the other sign. The bound leaves ~2.4x over the worst measured run. The fp8 runs must also differ from
bf16 (so this fails if nothing was converted), and the three stages must agree with each other (they compute
the same sums: measured bit for bit), as they do in bf16.
Checkpoints: an fp8 run's Fabric checkpoint loads into a plain model (zero3) and a plain run's into an fp8
model (zero2), each ending with exactly the weights saved; the fp8 run's full state dict loads strictly into
the example GPT with no strategy (``Float8Linear`` keeps the Linear's parameter names).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_scenario

RUNS = {"zero3_fp32": "zero3:precision=32-true"}
for _k in (1, 2, 3):
    RUNS[f"zero{_k}_bf16"] = f"zero{_k}" + (":save=1" if _k == 3 else "")
    RUNS[f"zero{_k}_fp8"] = f"zero{_k}:fp8=tensorwise" + (",save=1" if _k == 3 else "")
RUNS.update({"zero3_rowwise": "zero3:fp8=rowwise", "zero3_fp8_qwz": "zero3:fp8=tensorwise,qwz=int8", "plain_from_fp8": "zero3:load=zero3_fp8",
             "fp8_from_plain": "zero2:fp8=tensorwise,load=zero3_bf16"})
FP8 = ("zero1_fp8", "zero2_fp8", "zero3_fp8", "zero3_rowwise")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    run = run_scenario("quant.fp8", nprocs=2, params={"runs": RUNS}, out=tmp_path_factory.mktemp("fp8"),
                       timeout=900).check()
    return {name: run.saved(name) for name in RUNS}


def _dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    diff = torch.cat([(a[k] - b[k]).flatten() for k in b])
    return float(diff.norm() / torch.cat([b[k].flatten() for k in b]).norm())


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_fp8_tracks_bf16_and_differs_from_it(runs: dict[str, dict]) -> None:
    for name in FP8:
        got, ref = runs[name], runs[name.split("_")[0] + "_bf16"]
        assert got["linears"] == ["Linear"] + ["Float8Linear"] * 10 + ["Linear"], got["linears"]  # first, last kept
        assert got["same_params"]  # the optimizer was built on the user's Parameters, kept by the conversion
        assert _rel(got["losses"], ref["losses"]) <= 1e-3, (name, got["losses"], ref["losses"])
        assert got["losses"] != ref["losses"], name  # float8 happened
        assert 1e-3 < _dist(got["weights"], ref["weights"]) <= 0.04, name
    assert all(n == "Linear" for n in runs["zero3_bf16"]["linears"])
    assert _dist(runs["zero3_bf16"]["weights"], runs["zero3_fp32"]["weights"]) < 0.02  # the scale of the bound


def test_the_stages_agree_under_fp8(runs: dict[str, dict]) -> None:
    ref = runs["zero1_fp8"]
    for name in ("zero2_fp8", "zero3_fp8"):
        assert _rel(runs[name]["losses"], ref["losses"]) <= 1e-5, name
        assert _dist(runs[name]["weights"], ref["weights"]) <= 1e-4, name


def test_fp8_composes_with_the_quantized_weight_gather(runs: dict[str, dict]) -> None:
    """ZeRO++'s int8 weight all-gather (qwZ) under FP8 linears: the gathered bf16 weights are dequantized int8
    blocks, which Float8Linear then casts to float8 as it does any weight; 1 byte per element on the wire, as
    an fp8 all-gather would send. Two perturbations of about the same size (in this suite's runs fp8 alone is 0.017
    from bf16 and qwZ alone 0.029), so the weights are held to twice fp8's bound; measured (2026-11-29, CPU,
    torchao 0.18) losses within 2.2e-4 of bf16's and weights 0.031 (0.032 from fp8 alone)."""
    got, fp8, bf16 = runs["zero3_fp8_qwz"], runs["zero3_fp8"], runs["zero3_bf16"]
    assert got["linears"] == fp8["linears"]  # the same Linears converted
    assert _rel(got["losses"], bf16["losses"]) <= 1e-3, (got["losses"], bf16["losses"])
    assert _dist(got["weights"], bf16["weights"]) <= 0.08
    assert _dist(got["weights"], fp8["weights"]) > 1e-3  # the gather was quantized (else it equals fp8 alone)


def test_checkpoints_cross_between_fp8_and_plain_models(runs: dict[str, dict]) -> None:
    for loaded, saved in (("plain_from_fp8", "zero3_fp8"), ("fp8_from_plain", "zero3_bf16")):
        got, want = runs[loaded]["weights"], runs[saved]["weights"]
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want), loaded
    assert runs["plain_from_fp8"]["linears"] == ["Linear"] * 12
    assert "Float8Linear" in runs["fp8_from_plain"]["linears"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    from tests.quant.fp8_runs import SEQ, VOCAB

    plain = GPT(GPTConfig(vocab_size=VOCAB, n_layer=3, n_head=2, d_model=32, seq_len=SEQ))
    plain.load_state_dict(runs["zero3_fp8"]["weights"], strict=True)  # raises on any renamed or missing key
    assert all(torch.equal(plain.state_dict()[k].float(), v) for k, v in runs["zero3_fp8"]["weights"].items())
