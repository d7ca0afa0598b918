"""The fused Triton kernel of the bf16 device states (optim/triton_bf16_adam.py) against the reference, bit for bit.

On a GPU (marked ``gpu``: ``python -m pytest tests/states16 -m gpu``) the kernel runs on CUDA tensors and the
reference (optim/reference_lowp.py) on CPU copies; without a GPU, when Triton is installed, the same
comparison runs the kernel in Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable is
read when the kernel is defined). Values cover subnormal moments (gradients down to 1e-30), both layouts,
Adam and AdamW, fp32 and bf16 gradients, a loss-scale/clip coefficient and offsets past 2^32.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.optim.reference_lowp import adam_bf16_reference
from lightning_zero.optim.triton_bf16_adam import triton_available
from tests.helpers.launch import ROOT


def compare(device: str) -> list[str]:
    """Mismatching (case, step, tensor) descriptions; empty when the kernel equals the reference everywhere."""
    from lightning_zero.optim.triton_bf16_adam import triton_bf16_adam_step

    bad = []
    for kahan, adamw, grad_dtype, offset in itertools.product(
            (False, True), (True, False), (torch.float32, torch.bfloat16), (0, 2**32 - 1500)):
        n = 3001
        gen = torch.Generator().manual_seed(n + offset % 11)
        master = (torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)).bfloat16()
        zeros = torch.zeros(n, dtype=torch.bfloat16)
        ref = [master, zeros.clone() if kahan else None, zeros.clone(), zeros.clone()]
        ours = [None if t is None else t.to(device) for t in ref]
        hyper = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, adamw)
        for step in range(1, 5):
            grad = (torch.randn(n, generator=gen) * torch.logspace(-30, 1, n)).to(grad_dtype)
            kw = dict(step=step, grad_scale=3.7 if step % 2 else 1.0, seed=5, offset=offset)
            triton_bf16_adam_step(ours[0], ours[1], grad.to(device), ours[2], ours[3], hyper=hyper, **kw)
            adam_bf16_reference(ref[0], ref[1], grad, ref[2], ref[3], None, lr=hyper.lr, beta1=hyper.beta1,
                                beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                                adamw_mode=adamw, **kw)
            for name, a, b in zip(("master", "comp", "exp_avg", "exp_avg_sq"), ours, ref):
                if a is not None and not torch.equal(a.cpu().view(torch.int16), b.view(torch.int16)):
                    count = int((a.cpu().view(torch.int16) != b.view(torch.int16)).sum())
                    bad.append(f"kahan={kahan} adamw={adamw} {grad_dtype} offset={offset} step {step}: {name} "
                               f"differs in {count} of {n}")
    return bad


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU and Triton")
def test_kernel_equals_the_reference_on_cuda() -> None:
    assert compare("cuda") == []


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_kernel_equals_the_reference_in_the_interpreter() -> None:
    code = "from tests.states16.test_triton_bf16 import compare; bad = compare('cpu'); print(bad); assert not bad"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
