"""Starting the workers: spawned locally by pipetrain, or started by torchrun on one or many machines."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import runpy
import shutil
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from pipetrain.collector import loaded
from pipetrain.data.worker_deaths import lost_data_worker
from pipetrain.errors import PipetrainError
from pipetrain.runtime.errors import CommunicationError, DataWorkerLost, JoinError, LaunchError
from pipetrain.runtime.rendezvous import GENERATION, agree, generation, interface_towards
from pipetrain.runtime.settle import die_with_parent
from pipetrain.runtime.status import env_store, publish_error, read_errors
from pipetrain.runtime.supervise import EXIT_PEER_FAILURE, EXIT_USER_ERROR, LaunchResult, run_workers

__all__ = [
    "DistEnv",
    "detect",
    "init_distributed",
    "launch",
    "launch_script",
    "LaunchResult",
    "plan_cores",
    "EXIT_USER_ERROR",
    "report_worker_error",
    "EXIT_PEER_FAILURE",
]


_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: a spawned worker's program: settle the process (its cores), then import PyTorch with this module
_ENTRY = ("from pipetrain.runtime.settle import settle; settle(); "
          "from pipetrain.runtime.launch import {0}; {0}()")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the run, as read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "pipetrain", "torchrun" or "env" (variables set by hand)
    restart: int = 0


def detect(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """The distributed environment, or None when no launcher set one (a plain single process).

    Raises :class:`~pipetrain.runtime.errors.LaunchError` when it is set only in part.
    """
    env = os.environ if environ is None else environ
    present = [k for k in _REQUIRED if k in env]
    if not present:
        return None
    missing = [k for k in _REQUIRED if k not in env]
    if missing:
        raise LaunchError(
            f"the distributed environment is incomplete: {', '.join(present)} set but "
            f"{', '.join(missing)} missing; start workers with `pipetrain train --workers N` or "
            "torchrun, which set all of them"
        )
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", "0")))
        port = int(env["MASTER_PORT"])
    except ValueError as error:
        raise LaunchError(f"a distributed environment variable is not an integer: {error}") from None
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    if "PIPETRAIN_LAUNCHER" in env:
        launcher = "pipetrain"
    elif "TORCHELASTIC_RUN_ID" in env:
        launcher = "torchrun"
    else:
        launcher = "env"
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=env["MASTER_ADDR"],
        master_port=port,
        launcher=launcher,
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", env.get("PIPETRAIN_RESTART", "0"))),
    )


def init_distributed(backend: str = "gloo", timeout: float = 300.0) -> DistEnv:
    """Join the run's default process group from the environment (pipetrain's launcher, torchrun,
    or variables set by hand); ``timeout`` (seconds) bounds the rendezvous and every collective.

    Under a launcher that keeps the run's store (pipetrain's, torchrun's agents) the workers of
    this start agree on their generation first (:mod:`pipetrain.runtime.rendezvous`), which
    tolerates workers that start up to ``timeout`` apart and restarts that find the keys of a
    dead start. Gloo listens on the interface that reaches the store (loopback for a local run)
    unless ``GLOO_SOCKET_IFNAME`` says otherwise. A worker started by torchrun dies with its
    agent, so that a killed agent takes its workers with it and the run ends everywhere.

    With ``backend="nccl"`` the process first selects GPU LOCAL_RANK. Idempotent.
    """
    env = detect()
    if env is None:
        raise LaunchError(
            "no distributed environment: run the workers with `pipetrain train --workers N` (which "
            "spawns them) or under torchrun; by hand, set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
        )
    if dist.is_initialized():
        return env
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("backend 'nccl' needs CUDA GPUs; use backend='gloo' on CPU")
        torch.cuda.set_device(env.local_rank)
    elif backend != "gloo":
        raise LaunchError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if env.launcher == "torchrun":
        die_with_parent(os.getppid())
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_towards(env.master_addr, env.master_port)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    started = time.monotonic()
    td = datetime.timedelta(seconds=timeout)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the launcher hosts the store
            base = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=td,
                                 wait_for_workers=False)
            if env.launcher == "torchrun":  # one store for every restart: agree on this start's keys
                os.environ[GENERATION] = agree(base, env.rank, env.world_size, timeout)
            store = dist.PrefixStore(f"pipetrain/{generation()}/pg/", base)
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(seconds=max(1.0, timeout - (time.monotonic() - started))))
        else:
            dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                    timeout=td)
    except JoinError:
        raise
    except (RuntimeError, ValueError) as error:  # DistStoreError and DistNetworkError are RuntimeErrors
        raise JoinError(
            f"rank {env.rank} could not join the run at {env.master_addr}:{env.master_port} "
            f"({time.monotonic() - started:.1f} s after it tried; {type(error).__name__}: "
            f"{str(error).splitlines()[0]}); check that every worker started, and that the address is reachable"
        ) from None
    return env


def plan_cores(nprocs: int, threads_per_worker: int, available: Sequence[int] | None = None) -> list[list[int]] | None:
    """Disjoint core sets, ``threads_per_worker`` cores per worker, or None if there are too few."""
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    if nprocs * threads_per_worker > len(cores):
        return None
    return [cores[i * threads_per_worker : (i + 1) * threads_per_worker] for i in range(nprocs)]


def launch(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 2,
    *,
    threads_per_worker: int = 1,
    pin: bool = True,
    grace: float = 5.0,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    quiet: bool = False,
    restarts: int = 0,
    silence: float | None = None,
) -> LaunchResult:
    """Run ``fn(*args)`` in ``nprocs`` local worker processes (ranks 0..nprocs-1) and wait.

    The launcher hosts the run's TCPStore itself (on a free port of 127.0.0.1, listening there
    only, so there is no port race), starts one subprocess per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT set, pins each to its own cores, and watches them: when one fails, it prints what every
    rank was doing (from the store it hosts, which outlives any worker), gives the others a few seconds
    to report their own errors, then stops them. Ctrl-C stops every worker. It never waits forever.

    Under torchrun the same worker code runs unchanged: :func:`init_distributed` reads the environment
    torchrun sets. For two machines, run on each::

        torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
            --rdzv-id JOB worker.py

    Workers are subprocesses (not forks) started with ``python -c``: the entry function and its
    arguments are pickled by reference, the parent's ``sys.path`` is passed on, each worker lives in
    its own session (a Ctrl-C reaches only the launcher, which then stops them in order) and dies with
    the launcher (PR_SET_PDEATHSIG), so no worker outlives a killed launcher.

    ``fn`` must be importable by name (a module-level function) and ``args`` picklable. Each
    worker gets ``torch.set_num_threads(threads_per_worker)`` and, with ``pin`` and enough cores,
    its own ``threads_per_worker`` cores. When a worker fails, the others get ``grace`` seconds to
    exit on their own (peers of a dead rank report the loss), then are terminated. ``timeout``
    (seconds, optional) bounds each start of the workers. After a failure that is neither a
    user error nor an interruption, all workers are started again, up to ``restarts`` times (see
    :mod:`pipetrain.runtime.supervise`). ``silence`` (seconds, optional; the run's ``timeout``): a
    worker whose status board (:class:`~pipetrain.runtime.status.StatusBoard`) has published
    nothing for that long is stopped or frozen, and is killed (status 3), so that the run ends
    ``silence`` seconds after that worker was last heard, not after its peers' own waits run out.
    Returns a :class:`LaunchResult`: returncode 0, the
    primary failure's status (2 a user error, 3 a lost or timed-out peer, 128+N for a signal N),
    124 on timeout, 130 on Ctrl-C, 143 on SIGTERM.
    """
    if nprocs < 1:
        raise PipetrainError(f"need at least one worker, got {nprocs}")
    main_path = _main_path(fn)
    workdir = tempfile.mkdtemp(prefix="pipetrain-launch-")
    payload = os.path.join(workdir, "entry.pkl")
    try:
        with open(payload, "wb") as f:
            pickle.dump((fn, tuple(args)), f)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        _rmtree(workdir)
        raise PipetrainError(
            f"cannot hand {getattr(fn, '__qualname__', fn)!r} and its arguments to the workers: "
            f"{error}; use a module-level function and picklable arguments"
        ) from None
    command = [sys.executable, "-c", _ENTRY.format("_worker_main")]
    extra = dict(env or {}, PIPETRAIN_ENTRY=payload, PIPETRAIN_MAIN=main_path)
    try:
        result = run_workers(command, nprocs, threads_per_worker=threads_per_worker,
                             cores=plan_cores(nprocs, threads_per_worker) if pin else None, grace=grace,
                             timeout=timeout, env=extra, quiet=quiet, restarts=restarts, silence=silence)
        result.results = [_read_result(workdir, r) for r in range(nprocs)]
    finally:
        _rmtree(workdir)
    return result


def launch_script(
    nprocs: int,
    *,
    threads_per_worker: int = 1,
    pin: bool = True,
    grace: float = 5.0,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    quiet: bool = False,
    restarts: int = 0,
    silence: float | None = None,
) -> LaunchResult:
    """Run this process's own script again in ``nprocs`` local workers, as torchrun would, and wait.

    How ``python train.py`` trains on several processes with no launcher: the first distributed
    call of the script (:meth:`pipetrain.Pipeline.fit`) finds no distributed environment and
    starts the workers here; each runs the whole script from the top with RANK, WORLD_SIZE, ...
    set, so every rank builds the same model and data, and the same call joins the run. The
    launcher watches (and restarts) them exactly as :func:`launch` does. The script is found from the
    interpreter's own command line (``python script.py``, ``python -m package.module``); an
    interactive session or a test runner cannot be re-run and is refused.
    """
    head, script = _script_command()
    command = [sys.executable, *head, "-c", _ENTRY.format("_script_main")]
    return run_workers(command, nprocs, threads_per_worker=threads_per_worker,
                       cores=plan_cores(nprocs, threads_per_worker) if pin else None, grace=grace, timeout=timeout,
                       env=dict(env or {}, PIPETRAIN_SCRIPT=json.dumps(script)), quiet=quiet, restarts=restarts,
                       silence=silence)


#: programs whose command line re-run in a worker would not be the user's script
_NOT_SCRIPTS = ("pytest", "py.test", "ipykernel", "ipykernel_launcher", "IPython", "jupyter")


def _script_command() -> tuple[list[str], tuple[str, str, list[str]]]:
    """How to run this process's ``__main__`` again: the interpreter's options, and
    ``("module" or "path", name or path, arguments)``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    name = spec.name if spec is not None else os.path.splitext(os.path.basename(path or ""))[0]
    if not path or any(part in _NOT_SCRIPTS for part in name.split(".")) or (
        spec is None and os.path.basename(path).split(".")[0] in _NOT_SCRIPTS
    ):
        raise LaunchError(
            "the distributed executor runs your script once per worker, and this program "
            f"({'an interactive session' if not path else name}) cannot be run again: put the training in a "
            "script (python train.py) or under torchrun, or use executor='emulate' to train in this process"
        )
    options = list(getattr(sys, "orig_argv", [sys.executable])[1:])
    # interpreter options (-u, -X ..., -W ...) come before the script or -m in the original command line
    head: list[str] = []
    while options and options[0].startswith("-") and options[0] not in ("-m", "-c"):
        flag = options.pop(0)
        head.append(flag)
        if flag in ("-X", "-W") and options:
            head.append(options.pop(0))
    if spec is not None and spec.name != "__main__":
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return head, ("module", module, sys.argv[1:])
    return head, ("path", os.path.abspath(path), sys.argv[1:])


def _main_path(fn: Callable[..., Any]) -> str:
    """The script to re-run (as ``__mp_main__``) in workers when ``fn`` lives in ``__main__``."""
    if getattr(fn, "__module__", None) != "__main__":
        return ""
    path = getattr(sys.modules["__main__"], "__file__", None)
    if not path:
        raise PipetrainError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in an interactive session; workers "
            "cannot import it: put it in a module (a .py file) and pass it from there"
        )
    return os.path.abspath(path)


def _load_main() -> None:
    """Make ``__main__`` of a worker the launching script (its ``if __name__ == "__main__"`` block
    does not run), so that functions defined there can be unpickled."""
    path = os.environ.get("PIPETRAIN_MAIN")
    if not path:
        return
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _read_result(workdir: str, rank: int) -> Any:
    path = os.path.join(workdir, f"result-{rank}.pkl")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _threads() -> None:
    """A spawned worker's thread count (its cores were set by :func:`~pipetrain.runtime.settle.settle`
    before PyTorch was imported)."""
    torch.set_num_threads(int(os.environ.get("PIPETRAIN_THREADS", "1")))


def _worker_main() -> None:
    """Entry of a spawned worker (pinned by its command first): run the pickled function, store its
    result."""
    _threads()
    rank = int(os.environ["RANK"])
    entry = os.environ["PIPETRAIN_ENTRY"]

    def run() -> None:
        result = os.path.join(os.path.dirname(entry), f"result-{rank}.pkl")
        if os.path.exists(result):  # left by an earlier start of the workers (see launch's restarts)
            os.remove(result)
        _load_main()
        with open(entry, "rb") as f:
            fn, args = pickle.load(f)  # imports the modules fn needs
        loaded()  # what settle() paused: the collector runs again, blind to the loaded modules
        value = fn(*args)
        if value is not None:
            tmp = os.path.join(os.path.dirname(entry), f".result-{rank}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(value, f)
            os.replace(tmp, result)

    _run_and_exit(run, rank)


def _script_main() -> None:
    """Entry of a worker that runs the user's script (see :func:`launch_script`): as ``python
    script.py`` or ``python -m module`` would, with the script's own arguments (pinned by its
    command first)."""
    _threads()

    kind, target, arguments = json.loads(os.environ["PIPETRAIN_SCRIPT"])
    loaded()  # what settle() paused; the script's own imports are the script's

    def run() -> None:
        if kind == "module":
            sys.argv = [target, *arguments]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *arguments]
            sys.path[0] = os.path.dirname(target)
            runpy.run_path(target, run_name="__main__")

    _run_and_exit(run, int(os.environ["RANK"]))


def _run_and_exit(run: Callable[[], None], rank: int) -> None:
    """Run a worker's work and end the process with the launcher's exit statuses: 0, the error's
    ``exit_status`` for a PipetrainError (2 for a user error, 3 for a lost or timed-out peer), 130
    on Ctrl-C, a SystemExit's own code, 1 for anything else (with its traceback)."""
    try:
        run()
    except PipetrainError as error:
        if not report_worker_error(rank, error):
            print(f"pipetrain worker rank {rank}: error: {error}", file=sys.stderr, flush=True)
        os._exit(error.exit_status)
    except KeyboardInterrupt:
        os._exit(130)
    except SystemExit as exit_:
        code = exit_.code
        if code not in (None, 0):
            if not isinstance(code, int):
                print(f"pipetrain worker rank {rank}: {code}", file=sys.stderr, flush=True)
                code = 1
            sys.stdout.flush()
            os._exit(code)
    except BaseException as error:
        lost = lost_data_worker(error, rank)  # torch raises it wherever the worker was when its data worker died
        if lost is not None:
            if not report_worker_error(rank, lost):
                print(f"pipetrain worker rank {rank}: error: {lost}", file=sys.stderr, flush=True)
            os._exit(lost.exit_status)
        traceback.print_exc()
        print(f"pipetrain worker rank {rank}: failed (traceback above)", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    finish_worker()


def report_worker_error(rank: int, error: PipetrainError) -> bool:
    """Hand a worker's error to pipetrain's launcher, which prints it as the run's one message;
    True if the launcher will (the worker then prints nothing). Its own error (a user error: bad
    data, a NaN loss) is left in the launcher's store; a lost peer is not reported when another
    rank left its error there first (the peers of a failed rank only echo its failure). Under
    torchrun, or when the store does not answer, False: the worker prints the error itself."""
    if "PIPETRAIN_LAUNCHER" not in os.environ:
        return False
    try:
        store = env_store(timeout=2.0)
    except Exception:
        return False
    if isinstance(error, CommunicationError):
        world = int(os.environ.get("WORLD_SIZE", "0"))
        return any(other != rank for other in read_errors(store, world))
    if error.exit_status != EXIT_USER_ERROR and not isinstance(error, DataWorkerLost):
        return False  # a worker that could not join: it says so itself
    return publish_error(store, rank, str(error))


def finish_worker() -> None:
    """End a worker, spawned or started by torchrun: leave the process group cleanly so that no
    peer sees a reset for a normal exit, then end the process without running interpreter
    finalisation: destroying torch.distributed's C++ objects (pending p2p work, store clients) at
    interpreter exit intermittently aborted a worker ("terminate called without an active
    exception") after its work was done."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
