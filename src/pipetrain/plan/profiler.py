"""Measuring a model layer by layer: forward and backward time, activation and parameter bytes.

The *units* of a profile are the children of an ``nn.Sequential`` (a chain), or, for any other
model, the nodes of its ``torch.fx`` graph: leaf modules, functions (``add``, ``cat``, ...) and
inputs, with the graph's edges, so skip connections are visible to the planner.

Timing. Each unit's forward is timed around its call. For the backward, every unit's output and
every edge into a unit pass through an identity autograd function that notes the clock when the
gradient arrives: the backward of a unit runs from the gradient reaching its output to the last
gradient leaving towards its inputs (the same boundaries as full backward pre/post hooks, but for
function nodes too). A unit whose inputs need no gradient (the first layer) ends with the
backward pass. The loss is charged to the last unit. Each unit's time is the median (or the mean,
``statistic="mean"``) over ``iterations`` after ``warmup`` iterations: on a shared machine the
median ignores the iterations another process interrupted. On CUDA the device is synchronised at
every mark.

In-place activations (``ReLU(inplace=True)``) are switched off while profiling, since an in-place
write into a marked tensor is not allowed by autograd.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.execution.unit_timing import each_piece_alone
from pipetrain.initialiser import Init
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.stages import unit_pieces
from pipetrain.stages.staged import call_stage
from pipetrain.structure import flatten, map_values

__all__ = ["profile_model", "profile_by_unit", "STATISTICS"]

STATISTICS = {"median": statistics.median, "mean": statistics.fmean}


class _Clock:
    """Wall time (``time``: another source of seconds), the device synchronised first on CUDA."""

    def __init__(self, device: torch.device, time: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.time = time

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.time()


class _Mark(torch.autograd.Function):
    """Identity whose backward notes when the gradient passed through it."""

    @staticmethod
    def forward(ctx, x, sink, clock):  # type: ignore[override]
        ctx.sink, ctx.clock = sink, clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.sink.append(ctx.clock.now())
        return grad, None, None


def _mark(value: Any, sink: list, clock: _Clock) -> Any:
    if isinstance(value, torch.Tensor):
        if value.requires_grad and value.is_floating_point():
            return _Mark.apply(value, sink, clock)
        return value
    if isinstance(value, tuple):
        return tuple(_mark(v, sink, clock) for v in value)
    if isinstance(value, list):
        return [_mark(v, sink, clock) for v in value]
    if isinstance(value, dict):
        return {k: _mark(v, sink, clock) for k, v in value.items()}
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _kind(module: nn.Module) -> str:
    text = repr(module).replace("\n", " ")
    return " ".join(text.split())[:200]


class _Unit:
    def __init__(self, name: str, kind: str, run: Callable[..., Any], inputs: list[str],
                 parameters: list[torch.Tensor], is_input: bool = False,
                 module: str | None = None) -> None:
        self.name, self.kind, self.run, self.inputs = name, kind, run, inputs
        self.parameters, self.is_input, self.module = parameters, is_input, module


def _sequential_units(model: nn.Sequential) -> tuple[list[_Unit], Callable[[dict], Any]]:
    units = [_Unit("input", "Input", lambda x: x, [], [], is_input=True)]
    previous = "input"
    for name, child in model.named_children():
        units.append(_Unit(name, _kind(child), child, [previous], list(child.parameters()),
                           module=name))
        previous = name
    if len(units) == 1:
        raise ConfigError("the nn.Sequential to profile has no layers")
    return units, (lambda env, last=previous: env[last])


def _fx_units(model: nn.Module) -> tuple[list[_Unit], Callable[[dict], Any]]:

    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception as error:  # tracing failures come in many types
        raise ConfigError(
            f"cannot trace {type(model).__name__} with torch.fx ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); profile an nn.Sequential of "
            "its stages instead, or make its forward traceable") from None
    modules = dict(traced.named_modules())
    units: list[_Unit] = []
    output: Callable[[dict], Any] = lambda env: None
    for node in traced.graph.nodes:
        if node.op == "output":
            output = _node_runner(lambda value: value, node.args, {})
            continue
        inputs = [n.name for n in node.all_input_nodes]
        if node.op == "placeholder":
            units.append(_Unit(node.name, "Input", lambda x: x, [], [], is_input=True))
            continue
        if node.op == "get_attr":
            value = traced
            for part in node.target.split("."):
                value = getattr(value, part)
            params = [value] if isinstance(value, torch.Tensor) else []
            units.append(_Unit(node.name, f"get_attr {node.target}",
                               (lambda v: (lambda: v))(value), [], params))
            continue
        if node.op == "call_module":
            module = modules[node.target]
            fn: Callable[..., Any] = module
            kind = _kind(module)
            params = list(module.parameters())
        elif node.op == "call_method":
            fn = (lambda name: (lambda self, *a, **k: getattr(self, name)(*a, **k)))(node.target)
            kind = f"method {node.target}"
            params = []
        else:
            fn = node.target
            kind = getattr(node.target, "__name__", str(node.target))
            params = []
        units.append(_Unit(node.name, kind, _node_runner(fn, node.args, node.kwargs), inputs,
                           params, module=node.target if node.op == "call_module" else None))
    return units, output


def _node_runner(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
    """A callable taking a dict of computed node values, filling the fx node's arguments."""

    def resolve(value: Any, env: dict[str, Any]) -> Any:
        if isinstance(value, torch.fx.Node):
            return env[value.name]
        if isinstance(value, (tuple, list)):
            return type(value)(resolve(v, env) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v, env) for k, v in value.items()}
        return value

    def run(env: dict[str, Any]) -> Any:
        return fn(*resolve(args, env), **resolve(kwargs, env))

    run.uses_env = True  # type: ignore[attr-defined]
    return run


def profile_model(model: nn.Module, example: tuple[Any, torch.Tensor],
                  loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, *,
                  iterations: int = 10, warmup: int = 3, optimizer_states: float = 1.0,
                  device: str | torch.device | None = None, progress: bool = True,
                  meta: dict[str, Any] | None = None, statistic: str = "median",
                  clock: Callable[[], float] = time.perf_counter) -> Profile:
    """Profile ``model`` on one ``(input, target)`` batch; returns a :class:`Profile`.

    ``loss_fn`` defaults to cross-entropy. ``optimizer_states`` is the optimizer state per
    parameter in parameter sizes (0 plain SGD, 1 momentum SGD, 2 Adam). ``statistic`` (``median``
    or ``mean``) summarises each unit's times over the measured iterations. ``clock``: the source
    of seconds (wall time; any monotonic clock, e.g. one a test advances itself).
    """
    if iterations < 1 or warmup < 0:
        raise ConfigError("iterations must be >= 1 and warmup >= 0")
    if statistic not in STATISTICS:
        raise ConfigError(f"unknown statistic {statistic!r}; choose {' or '.join(STATISTICS)}")
    summarise = STATISTICS[statistic]
    loss_fn = loss_fn or nn.functional.cross_entropy
    device = torch.device(device) if device is not None else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    clock = _Clock(device, clock)
    inputs, target = example
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    target = target.to(device)
    model = model.to(device).train()
    restore = [(m, m.inplace) for m in model.modules()
               if isinstance(getattr(m, "inplace", None), bool) and m.inplace]
    for m, _ in restore:
        m.inplace = False
    try:
        units, output = _sequential_units(model) if isinstance(model, nn.Sequential) else \
            _fx_units(model)
        placeholders = [u for u in units if u.is_input]
        if len(placeholders) != len(inputs):
            raise ConfigError(f"the model takes {len(placeholders)} inputs but the example "
                              f"batch has {len(inputs)}")
        samples: dict[str, tuple[list[float], list[float]]] = {u.name: ([], []) for u in units}
        sizes: dict[str, int] = {}
        rounds = range(warmup + iterations)
        if progress:
            from tqdm import tqdm  # an optional dependency, for the progress bar alone

            rounds = tqdm(rounds, desc="profiling", unit="it", leave=False)
        for it in rounds:
            forward, backward, sizes = _one_iteration(model, units, output, inputs, target,
                                                      loss_fn, clock)
            if it >= warmup:
                for name, (fwd, bwd) in samples.items():
                    fwd.append(forward[name])
                    bwd.append(backward[name])
    finally:
        for m, value in restore:
            m.inplace = value
    seen: set[int] = set()
    layers = []
    for unit in units:
        pbytes = 0
        for p in unit.parameters:
            if id(p) not in seen:
                seen.add(id(p))
                pbytes += p.numel() * p.element_size()
        fwd, bwd = (summarise(v) for v in samples[unit.name])
        layers.append(LayerProfile(
            name=unit.name, kind=unit.kind, forward_s=0.0 if unit.is_input else fwd,
            backward_s=0.0 if unit.is_input else bwd, activation_bytes=float(sizes[unit.name]),
            parameter_bytes=float(pbytes), optimizer_bytes=float(pbytes * optimizer_states),
            input=unit.is_input))
    edges = [(src, unit.name) for unit in units for src in unit.inputs]
    batch = inputs[0].shape[0] if isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else None
    info = {"model": type(model).__name__, "device": str(device), "iterations": iterations,
            "warmup": warmup, "statistic": statistic, "optimizer_states": optimizer_states,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "modules": {u.name: u.module for u in units if u.module is not None}}
    info.update(meta or {})
    return Profile(layers=layers, edges=edges, batch_size=batch, meta=info)


def _one_iteration(model: nn.Module, units: Sequence[_Unit], output_of: Callable[[dict], Any],
                   inputs: tuple, target: torch.Tensor, loss_fn: Callable, clock: _Clock):
    for p in model.parameters():
        p.grad = None
    env: dict[str, Any] = {}
    forward: dict[str, float] = {}
    starts: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    feed = iter(inputs)
    for unit in units:
        starts[unit.name], ends[unit.name] = [], []
        if unit.is_input:
            value = next(feed)
            env[unit.name] = value
            forward[unit.name] = 0.0
            sizes[unit.name] = _nbytes(value)
            continue
        local = {src: _mark(env[src], ends[unit.name], clock) for src in unit.inputs}
        takes_env = getattr(unit.run, "uses_env", False)
        t0 = clock.now()
        if takes_env:
            out = unit.run(local)  # a node's runner reads only its own input nodes, all in local
        elif unit.inputs:
            out = unit.run(*[local[src] for src in unit.inputs])
        else:
            out = unit.run()
        forward[unit.name] = clock.now() - t0
        sizes[unit.name] = _nbytes(out)
        env[unit.name] = _mark(out, starts[unit.name], clock)
    last = units[-1].name
    t0 = clock.now()
    output = output_of(env)
    loss = loss_fn(output, target)
    forward[last] += clock.now() - t0
    t0 = clock.now()
    loss.backward()
    done = clock.now()
    backward: dict[str, float] = {}
    for unit in units:
        begin = max(starts[unit.name]) if starts[unit.name] else None
        if unit.name == last:
            begin = t0
        end = max(ends[unit.name]) if ends[unit.name] else done
        if not unit.inputs:             # a constant (get_attr): nothing to compute backward
            begin = None
        backward[unit.name] = max(0.0, end - begin) if begin is not None else 0.0
    return forward, backward, sizes


def profile_by_unit(model: nn.Module, example: tuple[Any, torch.Tensor],
                    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, *, init: Init | None = None,
                    seed: int = 0, iterations: int = 10, warmup: int = 3, optimizer_states: float = 1.0,
                    meta: dict[str, Any] | None = None, statistic: str = "median",
                    clock: Callable[[], float] = time.perf_counter) -> Profile:
    """A profile of ``model`` by pipeline unit (the pieces an automatic split chooses between, see
    :func:`~pipetrain.stages.unit_names`), each unit materialised alone, measured and freed: how a
    model built on the meta device (:mod:`pipetrain.stages.materialize`, first values from
    ``init`` under ``seed``) is profiled without ever holding it whole (one unit at a time, as
    :func:`pipetrain.execution.unit_timing.each_piece_alone` gives them).

    First the forwards alone give every unit its input; then each unit runs ``warmup`` +
    ``iterations`` forwards and backwards on it (the last with ``loss_fn``, the others with the
    sum of their floating outputs, so that a gradient of ones arrives). A unit's
    ``activation_bytes`` are what it hands on (all values crossing to the next unit); the layers
    form a chain.
    """
    if iterations < 1 or warmup < 0:
        raise ConfigError("iterations must be >= 1 and warmup >= 0")
    if statistic not in STATISTICS:
        raise ConfigError(f"unknown statistic {statistic!r}; choose {' or '.join(STATISTICS)}")
    summarise = STATISTICS[statistic]
    loss_fn = loss_fn or nn.functional.cross_entropy
    inputs, target = example
    names, pieces = unit_pieces(model, 1)
    last = len(pieces) - 1
    given_bytes = sum(t.numel() * t.element_size() for t in flatten(inputs)[0] if isinstance(t, torch.Tensor))
    layers = [LayerProfile(name="input", kind="Input", activation_bytes=float(given_bytes), input=True)]
    for s, piece, values in each_piece_alone(model, pieces, inputs, init, seed):
        name = names[s]
        params = [p for p in piece.parameters() if p.requires_grad]
        forward, backward = [], []
        for it in range(warmup + iterations):
            given = map_values(values[s], lambda t: t.detach().requires_grad_(t.is_floating_point()))
            start = clock()
            out = call_stage(piece, given)
            middle = clock()
            if s == last:
                loss = loss_fn(out, target)
            else:
                loss = sum(t.sum() for t in flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
            end = clock()
            for p in params:
                p.grad = None
            if it >= warmup:
                forward.append(middle - start)
                backward.append(end - middle)
        handed = 0 if s == last else sum(t.numel() * t.element_size() for t in flatten(values[s + 1])[0]
                                         if isinstance(t, torch.Tensor))
        weights = sum(p.numel() * p.element_size() for p in piece.parameters())
        layers.append(LayerProfile(name=name, kind=_unit_kind(model, name, piece), forward_s=summarise(forward),
                                   backward_s=summarise(backward), activation_bytes=float(handed),
                                   parameter_bytes=float(weights),
                                   optimizer_bytes=float(weights * optimizer_states)))
    first = next(iter(flatten(inputs)[0]), None)
    batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else None
    info = {"model": type(model).__name__, "device": "cpu", "iterations": iterations, "warmup": warmup,
            "statistic": statistic, "optimizer_states": optimizer_states, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "units": "pipeline units, each materialised alone"}
    info.update(meta or {})
    return Profile(layers=layers, edges=None, batch_size=batch, meta=info)


def _unit_kind(model: nn.Module, name: str, piece: nn.Module) -> str:
    """The class of the module unit ``name`` is (a declared unit's wrapper when it is none)."""
    try:
        return type(model.get_submodule(name)).__name__
    except AttributeError:
        return type(piece).__name__
