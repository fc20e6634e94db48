"""Starting the workers: spawned locally by pipetrain, or started by torchrun on one or many machines."""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pipetrain.errors import PipetrainError
from pipetrain.runtime.errors import LaunchError

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

#: Exit status of a worker that stopped on a PipetrainError of its own (a user error).
EXIT_USER_ERROR = 2
#: Exit status of a worker that stopped because of another rank (lost peer, timeout): a secondary
#: failure; the launcher names a primary failure first when it sees both.
EXIT_PEER_FAILURE = 3

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def init_distributed(backend: str = "gloo", timeout: float = 300.0) -> DistEnv:
    """Join the run's default process group from the environment (pipetrain's launcher, torchrun,
    or variables set by hand); ``timeout`` (seconds) bounds the rendezvous and every collective.

    With ``backend="nccl"`` the process first selects GPU LOCAL_RANK. Idempotent.
    """
    import torch
    import torch.distributed as dist

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
            raise LaunchError("backend 'nccl' needs CUDA GPUs; use --backend gloo on CPU")
        torch.cuda.set_device(env.local_rank)
    elif backend != "gloo":
        raise LaunchError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, ValueError) as error:  # DistStoreError and DistNetworkError are RuntimeErrors
        raise LaunchError(
            f"rank {env.rank} could not join the run at {env.master_addr}:{env.master_port} "
            f"within {timeout:g} s ({type(error).__name__}: {str(error).splitlines()[0]}); check "
            "that every worker started, and that the address is reachable"
        ) from None
    return env


def plan_cores(nprocs: int, threads_per_worker: int, available: Sequence[int] | None = None) -> list[list[int]] | None:
    """Disjoint core sets, ``threads_per_worker`` cores per worker, or None if there are too few."""
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    if nprocs * threads_per_worker > len(cores):
        return None
    return [cores[i * threads_per_worker : (i + 1) * threads_per_worker] for i in range(nprocs)]


@dataclass
class LaunchResult:
    """How the workers ended. ``returncode`` 0 means all succeeded; ``results[r]`` is what rank
    r's entry function returned (None if it failed or returned nothing)."""

    returncode: int
    results: list[Any] = field(default_factory=list)
    exitcodes: list[int | None] = field(default_factory=list)
    message: str = ""


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


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
) -> LaunchResult:
    """Run ``fn(*args)`` in ``nprocs`` local worker processes (ranks 0..nprocs-1) and wait.

    The launcher hosts the run's TCPStore itself (on a free port of 127.0.0.1, so there is
    no port race), starts one subprocess per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
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
    (seconds, optional) bounds the whole run. Returns a :class:`LaunchResult`: returncode 0, the
    first failure's status (128+N for a signal N), 124 on timeout, 130 on Ctrl-C.
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
    command = [sys.executable, "-c", "from pipetrain.runtime.launch import _worker_main; _worker_main()"]
    extra = dict(env or {}, PIPETRAIN_ENTRY=payload, PIPETRAIN_MAIN=main_path)
    try:
        result = _run_workers(command, nprocs, threads_per_worker=threads_per_worker, pin=pin, grace=grace,
                              timeout=timeout, env=extra, quiet=quiet)
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
) -> LaunchResult:
    """Run this process's own script again in ``nprocs`` local workers, as torchrun would, and wait.

    How ``python train.py`` trains on several processes with no launcher: the first distributed
    call of the script (:meth:`pipetrain.Pipeline.fit`) finds no distributed environment and
    starts the workers here; each runs the whole script from the top with RANK, WORLD_SIZE, ...
    set, so every rank builds the same model and data, and the same call joins the run. The
    launcher watches them exactly as :func:`launch` does. The script is found from the
    interpreter's own command line (``python script.py``, ``python -m package.module``); an
    interactive session or a test runner cannot be re-run and is refused.
    """
    import json

    head, script = _script_command()
    command = [sys.executable, *head, "-c", "from pipetrain.runtime.launch import _script_main; _script_main()"]
    return _run_workers(command, nprocs, threads_per_worker=threads_per_worker, pin=pin, grace=grace,
                        timeout=timeout, env=dict(env or {}, PIPETRAIN_SCRIPT=json.dumps(script)), quiet=quiet)


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


def _run_workers(
    command: list[str],
    nprocs: int,
    *,
    threads_per_worker: int,
    pin: bool,
    grace: float,
    timeout: float | None,
    env: Mapping[str, str],
    quiet: bool,
) -> LaunchResult:
    """Start ``command`` once per rank with the distributed environment set, watch and reap them
    (see :func:`launch`)."""
    import torch.distributed as dist

    if nprocs < 1:
        raise PipetrainError(f"need at least one worker, got {nprocs}")
    if threads_per_worker < 1:
        raise PipetrainError(f"--threads-per-worker must be at least 1, got {threads_per_worker}")
    cores = plan_cores(nprocs, threads_per_worker) if pin else None
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size=nprocs, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    base = dict(os.environ)
    base.update(env)
    path = [p for p in sys.path if p]
    base["PYTHONPATH"] = os.pathsep.join(path + [base["PYTHONPATH"]] if base.get("PYTHONPATH") else path)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of the store hosted here
        PIPETRAIN_LAUNCHER="1",
        PIPETRAIN_THREADS=str(threads_per_worker),
        PIPETRAIN_PARENT=str(os.getpid()),
        OMP_NUM_THREADS=str(threads_per_worker),
        MKL_NUM_THREADS=str(threads_per_worker),
    )
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        base.pop(key, None)

    def say(text: str) -> None:
        if not quiet:
            print(f"pipetrain launch: {text}", file=sys.stderr, flush=True)

    procs: list[subprocess.Popen[bytes]] = []
    result = LaunchResult(returncode=0)
    old_term = None
    try:
        if _in_main_thread():
            old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        for rank in range(nprocs):
            wenv = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            if cores is not None:
                wenv["PIPETRAIN_CPUS"] = ",".join(map(str, cores[rank]))
            procs.append(subprocess.Popen(command, env=wenv, start_new_session=True))
        result = _watch(procs, store, grace, timeout, say)
    except KeyboardInterrupt:
        say("interrupted: stopping every worker")
        _stop(procs, 3.0)
        result = LaunchResult(returncode=130, message="interrupted")
    finally:
        _stop(procs, 3.0)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        result.exitcodes = [p.poll() for p in procs]
        del store
    return result


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
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _watch(
    procs: list[subprocess.Popen[bytes]],
    store: Any,
    grace: float,
    timeout: float | None,
    say: Callable[[str], None],
) -> LaunchResult:
    from pipetrain.runtime.status import format_status, read_errors, read_status

    start = time.monotonic()
    first: tuple[int, int] | None = None
    stop_at: float | None = None
    message = ""
    while True:
        codes = [p.poll() for p in procs]
        if first is None:
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Peers of a dead rank exit within milliseconds of it: name the cause, not them.
                first = min(failed, key=lambda rc: (rc[1] >= 0, rc[1] == EXIT_PEER_FAILURE, rc[0]))
                errors = read_errors(store, len(procs)) if first[1] == EXIT_USER_ERROR else {}
                if first[0] in errors:  # the worker's own error (bad data, a NaN loss): the run's one message
                    message = errors[first[0]]
                else:
                    message = f"worker rank {first[0]} {_describe_exit(first[1])}"
                    if first[1] == EXIT_PEER_FAILURE:
                        message += " (it lost a peer or timed out waiting for one)"
                        finished = [r for r, c in enumerate(codes) if c == 0]
                        if finished:
                            message += (
                                f"; rank(s) {', '.join(map(str, finished))} had already finished "
                                "normally, before the others (do the programs match?)"
                            )
                    say(f"{message}; stopping the other workers")
                    say(format_status(read_status(store, len(procs), timeout=1.0), len(procs)))
                stop_at = time.monotonic() + grace
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            late = [r for r, c in enumerate(codes) if c is None]
            say(f"rank(s) {', '.join(map(str, late))} still running {grace:g} s later: terminating them")
            break
        if timeout is not None and now - start > timeout and first is None:
            message = f"the workers did not finish within {timeout:g} s"
            say(f"{message}; terminating them")
            say(format_status(read_status(store, len(procs), timeout=1.0), len(procs)))
            _stop(procs, 3.0)
            return LaunchResult(returncode=124, message=message)
        time.sleep(0.05)
    if first is None:
        return LaunchResult(returncode=0)
    code = first[1]
    return LaunchResult(returncode=128 - code if code < 0 else code, message=message)


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every live worker, SIGKILL those still alive ``grace`` seconds later, reap all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read_result(workdir: str, rank: int) -> Any:
    path = os.path.join(workdir, f"result-{rank}.pkl")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _die_with_parent() -> None:
    parent = int(os.environ.get("PIPETRAIN_PARENT", "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _settle() -> None:
    """A spawned worker's own process settings: die with the launcher, pin to its cores, one
    thread per core."""
    _die_with_parent()
    cpus = os.environ.get("PIPETRAIN_CPUS")
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    import torch

    torch.set_num_threads(int(os.environ.get("PIPETRAIN_THREADS", "1")))


def _worker_main() -> None:
    """Entry of a spawned worker: pin, run the pickled function, store its result."""
    _settle()
    rank = int(os.environ["RANK"])
    entry = os.environ["PIPETRAIN_ENTRY"]

    def run() -> None:
        _load_main()
        with open(entry, "rb") as f:
            fn, args = pickle.load(f)
        value = fn(*args)
        if value is not None:
            tmp = os.path.join(os.path.dirname(entry), f".result-{rank}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(value, f)
            os.replace(tmp, os.path.join(os.path.dirname(entry), f"result-{rank}.pkl"))

    _run_and_exit(run, rank)


def _script_main() -> None:
    """Entry of a worker that runs the user's script (see :func:`launch_script`): as ``python
    script.py`` or ``python -m module`` would, with the script's own arguments."""
    _settle()
    import json
    import runpy

    kind, target, arguments = json.loads(os.environ["PIPETRAIN_SCRIPT"])

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
    """Run a worker's work and end the process with the launcher's exit statuses: 0, 2 for a
    user error, 3 for a lost peer, 130 on Ctrl-C, a SystemExit's own code, 1 for anything else
    (with its traceback)."""
    try:
        run()
    except PipetrainError as error:
        from pipetrain.runtime.errors import CommunicationError

        lost_peer = isinstance(error, CommunicationError)
        if not report_worker_error(rank, error):
            print(f"pipetrain worker rank {rank}: error: {error}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILURE if lost_peer else EXIT_USER_ERROR)
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
    except BaseException:
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
    from pipetrain.runtime.errors import CommunicationError
    from pipetrain.runtime.status import env_store, publish_error, read_errors

    if "PIPETRAIN_LAUNCHER" not in os.environ:
        return False
    try:
        store = env_store(timeout=2.0)
    except Exception:
        return False
    if isinstance(error, CommunicationError):
        world = int(os.environ.get("WORLD_SIZE", "0"))
        return any(other != rank for other in read_errors(store, world))
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
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
