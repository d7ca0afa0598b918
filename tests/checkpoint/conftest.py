"""Session fixtures: each launch of scenario ``checkpoint.plan`` (scenarios.py) runs once, the first time a
test needs it.

* ``written`` (2 ranks): the zero3 reference run (6 steps, ModelCheckpoint every 3 steps), the same with
  ``checkpoint_async=True``, a ddp resume from the consolidated step-3 checkpoint, a zero3 resume from
  the async one, the GAN under zero3 (saved after global step 4), one measured save per stage/offload
  setting, and a save_top_k=1 run;
* ``killed`` (2 ranks): the reference run again, rank 1 SIGKILLed while writing the step-6 checkpoint;
* ``three_ranks`` / ``one_rank`` / ``four_ranks``: resumes of the reference and the GAN under other
  stages and world sizes, the resume after the kill, and loads of corrupted copies (3 ranks, last).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.checkpoint.launch import Launch, launch

MEM_SPECS = ["zero1", "zero2", "zero3", "zero3_offload", "zero3_offload_nvme"]
STEPS = 6
SAVE_EVERY = 3
GAN_SAVE = 4  # global steps (two per GAN batch)
GAN_STEPS = 8
STEP3 = f"epoch=0-step={SAVE_EVERY}.ckpt"
STEP6 = f"epoch=0-step={STEPS}.ckpt"
CORRUPT = {"flip": "__1_0.distcp", "trunc": "__0_0.distcp"}
"""Corruption kind -> the shard file it damages (in a copy of the reference's step-3 checkpoint)."""


def reference_step(name: str, out: Path, **extra) -> dict:
    return {"name": name, "model": "net", "strategy": "zero3", "steps": STEPS,
            "ckpt": {"dirpath": str(out / f"{name}_ckpts"), "every": SAVE_EVERY, "top_k": -1},
            "capture_at": [SAVE_EVERY, STEPS], **extra}


def resume_step(name: str, strategy: str, src: Path, out: Path, model: str = "net", steps: int = STEPS) -> dict:
    return {"name": name, "model": model, "strategy": strategy, "steps": steps, "resume": str(src),
            "record_start": True, "resave": str(out / "resave" / f"{name}.ckpt")}


class Paths:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.z3 = out / "z3_ckpts"
        self.z3_step3 = self.z3 / STEP3
        self.z3_full = out / "z3_step3_full.ckpt"
        self.z3_async = out / "z3_async_ckpts"
        self.gan = out / "gan_ckpts" / f"step{GAN_SAVE}.ckpt"
        self.topk = out / "topk_ckpts"

    def mem(self, spec: str) -> Path:
        return self.out / "mem" / f"{spec}.ckpt"


@pytest.fixture(scope="session")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Launch, Paths]:
    out = tmp_path_factory.mktemp("ckpt_written")
    p = Paths(out)
    plan = [
        reference_step("z3", out),
        reference_step("z3_async", out, zero={"checkpoint_async": True}, wait=True),
        {"name": "consolidate_z3", "task": "consolidate", "src": str(p.z3_step3), "dst": str(p.z3_full)},
        resume_step("ddp_resume", "ddp", p.z3_full, out),
        resume_step("z3_async_resume", "zero3", p.z3_async / STEP3, out),
        {"name": "gan_z3", "model": "gan", "strategy": "zero3", "steps": GAN_STEPS,
         "save_at": {str(GAN_SAVE): str(p.gan)}, "capture_at": [GAN_SAVE]},
        *({"name": f"mem_{s}", "model": "net", "strategy": s, "steps": 2, "save_at": {"2": str(p.mem(s))},
           "track_memory": True} for s in MEM_SPECS),
        {"name": "topk", "model": "net", "strategy": "zero2", "steps": 5,
         "ckpt": {"dirpath": str(p.topk), "every": 1, "top_k": 1, "save_last": True, "monitor": "step", "mode": "max"}},
    ]
    return launch(out, 2, plan, timeout=400), p


@pytest.fixture(scope="session")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Launch, Path, list[str]]:
    """The killed launch, its checkpoint directory, and that directory's listing right after the kill."""
    out = tmp_path_factory.mktemp("ckpt_killed")
    ckpts = out / "kill_ckpts"
    step = reference_step("kill", out, kill_on_save=3)  # saves: step 3, last (step 3), step 6 <- killed
    step["ckpt"]["save_last"] = True
    run = launch(out, 2, [step], timeout=180, launcher="torchrun")  # torchrun's own reaction is under test
    listing = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    return run, ckpts, listing


@pytest.fixture(scope="session")
def three_ranks(written: tuple[Launch, Paths], killed: tuple[Launch, Path, list[str]],
                tmp_path_factory: pytest.TempPathFactory) -> Launch:
    _, p = written
    _, kill_dir, _ = killed
    out = tmp_path_factory.mktemp("ckpt_three")
    plan = [
        resume_step("z3_to_z2", "zero2", p.z3_step3, out),
        resume_step("gan_to_z2", "zero2", p.gan, out, model="gan", steps=GAN_STEPS),
        {"name": "kill_resume", "model": "net", "strategy": "zero2", "steps": STEPS, "resume": "last",
         "record_start": True,
         "ckpt": {"dirpath": str(kill_dir), "every": SAVE_EVERY, "top_k": -1, "save_last": True}},
    ]
    for kind, victim in CORRUPT.items():
        bad = out / f"corrupt_{kind}.ckpt"
        if p.z3_step3.is_dir():
            shutil.copytree(p.z3_step3, bad)
            damage(bad / victim, kind)
        plan.append({"name": f"corrupt_{kind}", "model": "net", "strategy": "zero2", "steps": STEPS,
                     "resume": str(bad)})
    return launch(out, 3, plan, timeout=400)


def damage(path: Path, kind: str) -> None:
    """``flip``: invert 64 bytes in the middle of the file; ``trunc``: cut the file to half its size."""
    data = bytearray(path.read_bytes())
    assert len(data) > 256, (path, len(data))
    if kind == "flip":
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


@pytest.fixture(scope="session")
def one_rank(written: tuple[Launch, Paths], tmp_path_factory: pytest.TempPathFactory) -> Launch:
    _, p = written
    out = tmp_path_factory.mktemp("ckpt_one")
    return launch(out, 1, [resume_step("z3_to_z1", "zero1", p.z3_step3, out)], timeout=200)


@pytest.fixture(scope="session")
def four_ranks(written: tuple[Launch, Paths], tmp_path_factory: pytest.TempPathFactory) -> Launch:
    _, p = written
    out = tmp_path_factory.mktemp("ckpt_four")
    return launch(out, 4, [resume_step("z3_to_z3off", "zero3_offload", p.z3_step3, out)], timeout=300)
