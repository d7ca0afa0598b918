"""A Fourier neural operator as the neuraloperator community writes it: spectral convolutions whose weights
are complex, applied to the low modes of ``torch.fft.rfft2``, beside pointwise 1x1 convolutions.

ZeRO partitions real parameters only, so trainable complex ones are refused up front
(``engines.check_real_params``; tests/unit/test_bad_input.py). This model is the fix the refusal names: the
same weights stored as real pairs (``torch.view_as_real``) and viewed as complex in ``forward``, which is
how torch's optimizers step a complex parameter anyway, so ddp and every stage must train it alike. A complex
buffer (a fixed spectral filter, as torchtitan's Llama keeps its rotary ``freqs_cis``) rides along: buffers are
broadcast like ddp's, complex or not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from tests.zoo.base import N_TRAIN, ZooModule


class SpectralConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, modes1: int, modes2: int, complex_weights: bool = False) -> None:
        super().__init__()
        self.modes1, self.modes2, self.cout = modes1, modes2, cout
        scale = 1 / (cin * cout)
        w1 = scale * torch.rand(cin, cout, modes1, modes2, dtype=torch.cfloat)
        w2 = scale * torch.rand(cin, cout, modes1, modes2, dtype=torch.cfloat)
        wrap = (lambda w: w) if complex_weights else torch.view_as_real
        self.weights1 = nn.Parameter(wrap(w1))
        self.weights2 = nn.Parameter(wrap(w2))
        self.register_buffer("filter", torch.polar(torch.ones(modes1, modes2), torch.rand(modes1, modes2)))

    def _w(self, w: Tensor) -> Tensor:
        return w if w.is_complex() else torch.view_as_complex(w)

    def forward(self, x: Tensor) -> Tensor:
        m1, m2 = self.modes1, self.modes2
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], self.cout, x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat)
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self._w(self.weights1)) * self.filter
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self._w(self.weights2))
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO(ZooModule):
    """Lift, two Fourier layers (spectral + pointwise), project; regress a shifted, damped copy of the input."""

    def __init__(self, width: int = 8, modes: int = 3, complex_weights: bool = False) -> None:
        super().__init__()
        self.lift = nn.Conv2d(1, width, 1)
        self.spectral = nn.ModuleList([SpectralConv2d(width, width, modes, modes, complex_weights) for _ in range(2)])
        self.pointwise = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(2)])
        self.proj = nn.Conv2d(width, 1, 1)

    def train_data(self) -> Dataset:
        g = torch.Generator().manual_seed(5)
        a = torch.randn(N_TRAIN, 1, 16, 16, generator=g)
        return TensorDataset(a, torch.roll(a, 1, -1) * 0.5)

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.spectral)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.lift(x)
        for spectral, pointwise in zip(self.spectral, self.pointwise):
            h = F.gelu(spectral(h) + pointwise(h))
        return self.record(F.mse_loss(self.proj(h), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=1e-4)
