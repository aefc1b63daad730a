"""The ranks of a server whose core is split over tensor-parallel ranks (flare_core.parallel):
worker processes, the group they form with the server, and the executor through which rank 0
leads them. On the CPU the group is gloo's; on GPUs (`flare run --gpus 0,1`) each rank has its
own GPU and the group is NCCL's, whose all-reduces the CUDA graphs capture with the rest of a step.
Both run this same code: only the devices and the backend differ.

`flare run` is rank 0: it serves HTTP, schedules and samples as any server does. `RankLeader`
starts one worker process per other rank; each joins the group, loads its rank's share of the
core onto its device, and builds the executor rank 0 builds, in step with it (`build`, then on
CUDA `resize`: building warms and captures the model, whose collectives must meet rank 0's),
over the same number of pages. For every step,
rank 0 first sends the step's plan to every worker (`LeadingExecutor.step`); all ranks then run
the step's forward, whose all-reduces meet inside the model; rank 0 samples and sends the sampled
tokens, which each worker records as its rows' next decode inputs. Every rank thus issues the
same collectives in the same order, holds the same pages, restores and snapshots, and never
samples on its own. Plans and tokens travel over one multiprocessing queue per worker (an idle
server waits there without a collective that could time out); only the model's all-reduces use
the group.

A rank that fails breaks the group: the others' next all-reduce raises, so rank 0's step fails
and the server exits 1 (the worker-failure path). A worker whose server process is gone stops.
Closing sends each worker a stop and waits for it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path
from typing import Any

import torch

from flare_core.engine.tables import TableOptions

# How long a rank waits for the others to join the group, and for a collective to complete.
GROUP_TIMEOUT = datetime.timedelta(seconds=300)
# How long rank 0 waits for the workers to load their shares and build their executors.
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def threads_per_rank(ranks: int) -> int:
    """CPU threads for each rank's kernels: the host's cores shared among the ranks."""
    return max(1, (os.cpu_count() or 1) // ranks)


class RankLeader:
    """Rank 0's side of the group: starts the workers (`start`), joins the group, has them build
    the executor rank 0 builds (`build`, on CUDA then `resize`), leads them once they are ready
    (`lead`) and stops them (`close`)."""

    def __init__(self, core_path: Path, ranks: int, tables: TableOptions, devices: tuple[str, ...]):
        self.ranks, self.devices = ranks, devices
        self.backend = backend_of(devices)
        self._directory = Path(tempfile.mkdtemp(prefix="flare-ranks-"))
        context = multiprocessing.get_context("spawn")
        self._commands = [context.Queue() for _ in range(1, ranks)]
        self._status = context.Queue()
        self._workers = [context.Process(target=run_worker, name=f"flare-rank-{rank}", daemon=True,
                                         args=(str(core_path), rank, ranks, str(self._directory / "group"),
                                               self._commands[rank - 1], self._status, tables, devices[rank]))
                         for rank in range(1, ranks)]
        self._joined = False
        self._closing = False

    @classmethod
    def start(cls, core_path: Path, ranks: int, tables: TableOptions = TableOptions(),
              devices: tuple[str, ...] | None = None) -> RankLeader:
        """Start the workers and join the group as rank 0 (waits for every worker to join);
        `tables`: where each rank serves the core's embedding tables from; `devices`: each rank's
        device ("cpu", or "cuda:N" for all: an NCCL group), rank 0's first (default: the CPU)."""
        devices = devices or ("cpu",) * ranks
        if len(devices) != ranks:
            raise ValueError(f"{len(devices)} devices for {ranks} tensor-parallel ranks")
        leader = cls(core_path, ranks, tables, devices)
        try:
            for worker in leader._workers:
                worker.start()
            join(leader.backend, leader._directory / "group", 0, ranks, devices[0])
            leader._joined = True
        except BaseException:
            leader.close()
            raise
        return leader

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    def build(self, kind: str, executor_args: dict) -> None:
        """Have every worker build the executor rank 0 builds next: `kind` "cuda" (flare_core.
        executor.graphs.cuda_runner, then `resize`) or "cpu" (eager_runner), with rank 0's
        arguments (its device replaced by the worker's own)."""
        for commands in self._commands:
            commands.put(("build", kind, executor_args))

    def resize(self, num_pages: int) -> None:
        """Have every worker's CUDA executor take the planned page pool, as rank 0's does next."""
        for commands in self._commands:
            commands.put(("resize", num_pages))

    def lead(self, executor: Any) -> LeadingExecutor:
        """Wait until every worker has built its executor (`build`), and lead them with rank 0's
        `executor`; RuntimeError naming a worker that failed or died."""
        ready: set[int] = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < len(self._workers):
            try:
                kind, rank, detail = self._status.get(timeout=1.0)
            except queue.Empty:
                dead = [w.name for w in self._workers if not w.is_alive()]
                if dead:
                    raise RuntimeError(f"tensor-parallel worker {dead[0]} exited during start-up") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel workers not ready after {READY_TIMEOUT_S:.0f} s") from None
                continue
            if kind == "failed":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")
            ready.add(rank)
        return LeadingExecutor(executor, self._commands, self.ranks, self.backend)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(cause)` (from a watcher thread) when a worker exits before `close`: an idle
        server would otherwise learn of it only from the next request's step."""
        sentinels = {worker.sentinel: worker for worker in self._workers}

        def watcher() -> None:
            exited = wait_for_exit(list(sentinels))
            if not self._closing:
                worker = sentinels[exited[0]]
                worker.join(1.0)  # its exit status
                on_exit(f"tensor-parallel worker {worker.name} (pid {worker.pid}) exited with status {worker.exitcode}")

        threading.Thread(target=watcher, name="flare-rank-watch", daemon=True).start()

    def close(self) -> None:
        """Stop the workers (after the engine's model thread has stopped: no step is in flight)."""
        import torch.distributed as dist

        self._closing = True
        for commands, worker in zip(self._commands, self._workers):
            if worker.is_alive():
                commands.put(("stop",))
        for worker in self._workers:
            if worker.pid is None:
                continue
            worker.join(STOP_TIMEOUT_S)
            if worker.is_alive():
                worker.terminate()
                worker.join()
        if self._joined:
            dist.destroy_process_group()
            self._joined = False
        shutil.rmtree(self._directory, ignore_errors=True)


class LeadingExecutor:
    """Rank 0's executor: `step` sends each worker the plan, runs it (the workers run its forward
    alongside), then sends the tokens it sampled. Everything else is the wrapped executor's."""

    def __init__(self, executor: Any, commands: list, ranks: int, backend: str):
        self._executor = executor
        self._commands = commands
        self._ranks, self._backend = ranks, backend

    def step(self, plan, sampling):
        for commands in self._commands:
            commands.put(("step", plan))
        output = self._executor.step(plan, sampling)
        if plan.samples:
            tokens = output.token_ids.to("cpu")
            for commands in self._commands:
                commands.put(("sampled", tokens))
        return output

    def summary(self) -> str:
        return f"{self._executor.summary()}, tensor-parallel over {self._ranks} ranks ({self._backend})"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


def backend_of(devices: tuple[str, ...]) -> str:
    """The group's backend for the ranks' devices: NCCL for GPUs, gloo for the CPU."""
    kinds = {torch.device(device).type for device in devices}
    if kinds == {"cuda"}:
        return "nccl"
    if kinds == {"cpu"}:
        return "gloo"
    raise ValueError(f"tensor-parallel ranks on {', '.join(devices)}: all on GPUs or all on the CPU")


def join(backend: str, group_file: Path, rank: int, ranks: int, device: str) -> None:
    """Join the group as `rank` on `device` (a CPU rank's kernels take its share of the cores)."""
    import torch.distributed as dist

    if backend == "gloo":
        torch.set_num_threads(threads_per_rank(ranks))
        dist.init_process_group("gloo", init_method=f"file://{group_file}", rank=rank, world_size=ranks,
                                timeout=GROUP_TIMEOUT)
        return
    torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl", init_method=f"file://{group_file}", rank=rank, world_size=ranks,
                            timeout=GROUP_TIMEOUT, device_id=torch.device(device))


def run_worker(core_path: str, rank: int, ranks: int, group_file: str, commands, status,
               tables: TableOptions = TableOptions(), device: str = "cpu") -> None:
    """A worker process: join the group, load rank `rank`'s share of the core onto `device`, build
    the executor rank 0 describes, then follow rank 0's steps until told to stop."""
    import torch.distributed as dist

    try:
        join(backend_of((device,)), Path(group_file), rank, ranks, device)
        executor = _build_executor(core_path, rank, commands, tables, device)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which fails its start-up
        status.put(("failed", rank, f"{type(exc).__name__}: {exc}"))
        return
    status.put(("ready", rank, None))
    try:
        _follow(executor, commands)
    finally:
        dist.destroy_process_group()


def _build_executor(core_path: str, rank: int, commands, tables: TableOptions, device: str):
    from flare_core.core import open_core
    from flare_core.executor.runner import eager_runner
    from flare_core.plugins import load_registry
    from flare_core.engine.load import load_core

    registry = load_registry()
    # The signature is checked on opening; rank 0 verified the payload hashes and the publisher.
    loaded = load_core(open_core(Path(core_path)), registry, torch.device(device), rank, tables)
    message = _next(commands)
    if message is None or message[0] != "build":
        raise RuntimeError(f"expected the executor's geometry from rank 0, got {message!r}")
    _, kind, executor_args = message
    executor_args = dict(executor_args, device=torch.device(device))
    if kind == "cpu":
        return eager_runner(loaded.model, loaded.cache_scheme, **executor_args)
    from flare_core.executor.graphs import cuda_runner

    executor = cuda_runner(loaded.model, loaded.cache_scheme, **executor_args)
    message = _next(commands)
    if message is None or message[0] != "resize":
        raise RuntimeError(f"expected the page pool from rank 0, got {message!r}")
    executor.resize_cache(message[1])
    return executor


def _follow(executor, commands) -> None:
    while True:
        message = _next(commands)
        if message is None or message[0] == "stop":
            return
        plan = message[1]
        executor.run_scored(plan)
        if plan.samples:
            sampled = _next(commands)
            if sampled is None or sampled[0] != "sampled":
                return
            executor.record_sampled([h.state_row for h in plan.samples], sampled[1])


def _next(commands):
    """The next message from rank 0; None once the server process is gone."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return commands.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None
