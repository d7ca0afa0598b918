"""The shape of the configuration and of the package's imports (issue #29).

Defaults are written once: every option a ``ZeroStrategy()`` or ``ZeroFabricStrategy()`` ends up with, and
what an engine reads from its typed piece, equals the default of the concern dataclass that declares the
field (config/strategy.py [Note: adding a concern]); no module outside ``lightning_zero/config`` reads an
option with a fallback of its own (the ``opts.get("param_persistence_threshold", 0)`` that drifted from
ZeroConfig's 100,000). And ``lightning_zero``'s imports have no cycle, lazy (function-level) ones included.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from lightning_zero.config import SECTIONS, OffloadConfig, Stage3Config, ZeroConfig
from lightning_zero.config.presets import PRESETS

PACKAGE = Path(lightning_zero.__file__).parent


def _default(f: Any) -> Any:
    assert f.default is not MISSING or f.default_factory is not MISSING, f"{f.name} has no default"
    return f.default if f.default is not MISSING else f.default_factory()


def test_the_concerns_partition_zeroconfig() -> None:
    """Every ZeroConfig field is declared by exactly one concern, and ZeroConfig declares none itself."""
    declared = [f.name for cls in SECTIONS for f in fields(cls)]
    assert len(declared) == len(set(declared)), "an option name is declared by two concerns"
    assert sorted(declared) == sorted(f.name for f in fields(ZeroConfig))
    assert not ZeroConfig.__dict__.get("__annotations__"), "ZeroConfig restates fields its concerns declare"


@pytest.mark.parametrize("bad", [
    {"stage": 4}, {"prefetch_units": -1}, {"activation_offload_policy": "Block"}, {"schedule": "zigzag"},
    {"offload_optimizer": "disk"}, {"compile_options": {"mode": "x"}}, {"start_method": "thread"},
    {"checkpoint_format": "zip"}, {"nonfinite": "warn"}, {"activation_offload_device_fraction": 2.0},
], ids=lambda bad: next(iter(bad)))
def test_each_concern_validates_itself(bad: dict) -> None:
    """A concern built on its own refuses its bad values, as ZeroConfig (which builds every concern) does."""
    (name, _), = bad.items()
    cls = next(c for c in SECTIONS if name in {f.name for f in fields(c)})
    with pytest.raises(ValueError, match=name if name != "stage" else "ZeRO stage"):
        cls(**bad)
    with pytest.raises(ValueError, match=name if name != "stage" else "ZeRO stage"):
        ZeroConfig(**bad)


@pytest.mark.parametrize("make", [ZeroStrategy, ZeroFabricStrategy], ids=["trainer", "fabric"])
def test_strategy_defaults_are_the_dataclass_defaults(make: type) -> None:
    strategy = make()
    for cls in SECTIONS:
        piece = strategy.config.piece(cls)
        assert type(piece) is cls
        for f in fields(cls):
            want = _default(f)
            assert getattr(strategy.config, f.name) == want, f.name
            assert getattr(piece, f.name) == want, f.name
    for name, param in inspect.signature(make.__init__).parameters.items():  # e.g. stage=ZeroConfig.stage
        if name in {f.name for f in fields(ZeroConfig)} and param.default is not inspect.Parameter.empty:
            assert param.default == _default(next(f for f in fields(ZeroConfig) if f.name == name)), name


def test_presets_and_keywords_name_options_flat() -> None:
    """Registered presets name ZeroConfig fields; a flat keyword lands in its concern's piece."""
    names = {f.name for f in fields(ZeroConfig)}
    for preset in PRESETS.values():
        assert set(preset) <= names
    config = ZeroConfig.from_kwargs(stage=3, prefetch_units=3, offload_optimizer="cpu", offload_params="cpu")
    assert config.piece(Stage3Config).prefetch_units == 3
    assert config.piece(OffloadConfig).offload_params == "cpu" and config.offloads
    with pytest.raises(TypeError, match="Unknown ZeroStrategy option"):
        ZeroConfig.from_kwargs(prefetch_unit=3)


def test_stage3_engine_reads_its_piece() -> None:
    """The values a stage-3 engine runs with are its piece's, so ZeroStrategy()'s defaults (no restated
    fallback: the persistence threshold was 0 in the engine, 100,000 in ZeroConfig)."""
    from lightning_zero.zero.stage3 import Stage3Engine

    defaults = {f.name: _default(f) for f in fields(Stage3Config)}
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    piece = ZeroStrategy(stage=3).config.piece(Stage3Config)
    engine = Stage3Engine(torch.optim.AdamW(model.parameters()), None, torch.float32, torch.device("cpu"), 1024,
                          module=model, stage3=piece)
    assert engine.prefetch_units == defaults["prefetch_units"]
    assert engine.max_live == defaults["max_live_parameters"]
    units = engine.units[1:]
    assert len(units) == 2
    assert [u.persistent for u in units] == [u.numel <= defaults["param_persistence_threshold"] for u in units] == [True, True]


def _calls_with_fallback(tree: ast.AST, names: set[str]) -> list[str]:
    """``x.get("<option>", default)``, ``x.pop(...)``, ``x.setdefault(...)``, ``getattr(x, "<option>", default)``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        bag = isinstance(fn, ast.Attribute) and fn.attr in ("get", "pop", "setdefault") and len(node.args) == 2
        attr = isinstance(fn, ast.Name) and fn.id == "getattr" and len(node.args) == 3
        key = node.args[-2] if bag or attr else None
        if isinstance(key, ast.Constant) and key.value in names:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_option_is_read_with_a_fallback_of_its_own() -> None:
    names = {f.name for f in fields(ZeroConfig)}
    offenders = {
        str(path.relative_to(PACKAGE)): hits
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "config"
        for hits in [_calls_with_fallback(ast.parse(path.read_text()), names)]
        if hits
    }
    assert not offenders, f"options read with a default restated outside lightning_zero/config: {offenders}"


# ---------------------------------------------------------------------------------------------- imports
def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of the file, so lazy imports count).

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``; parent
    packages, which Python imports first anyway, are not edges of their own."""
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == PACKAGE.name and resolve(target) not in ("", mod):
                    graph[mod].add(resolve(target))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (a path that returns to its first module), or [] when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str]:
        state[mod] = 1
        path.append(mod)
        for nxt in sorted(graph[mod]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[mod] = 2
        path.pop()
        return []

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)):
            return found
    return []


def test_the_import_graph_has_no_cycle() -> None:
    graph = _import_graph()
    assert len(graph) > 100 and "lightning_zero.registry" in graph["lightning_zero"]
    assert "lightning_zero.strategy" in graph["lightning_zero.registry"]  # the graph sees what it must
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and the walk finds one
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)
