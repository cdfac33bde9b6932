"""Several processes, one mesh: ``initialize_distributed`` and the local ``launch``er.

JAX's own multi-controller runtime (``jax.distributed``) joins the processes; every process
runs the same program over the global mesh, each driving its local devices. A sharded
model trains as it does in one process: each process builds the same model (same seeds)
and passes its own rows of the global batch to ``shard_batch(..., process_local=True)``::

    jaxrec launch -n 2 --cpu-devices 4 -- python train.py      # 2 processes x 4 CPU devices

    # train.py
    import jaxrec.parallel as par
    par.initialize_distributed()          # from the launcher's environment, or a cluster's
    mesh = jax.make_mesh((jax.device_count(),), ("data",))   # 8 devices over 2 processes
    model = par.shard(build_model(), plan, mesh)
    loss = step(model, optimizer, par.shard_batch(my_rows, mesh, process_local=True))

On CPU the cross-process collectives are gloo's (``jax_cpu_collectives_implementation``),
which ``initialize_distributed`` selects. Tested (``tests/parallel/test_multiprocess.py``):
2 processes x 4 CPU devices train a sharded DLRM of every sharding type equal to one
process x 8 devices (docs/multiprocess.md says what is not built yet).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import jax

# What ``launch`` tells each process (read by ``initialize_distributed``).
ENV_COORDINATOR = "JAXREC_COORDINATOR"
ENV_NUM_PROCESSES = "JAXREC_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXREC_PROCESS_ID"


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, timeout_s: int = 120) -> None:
    """Joins this process to the others (``jax.distributed.initialize``); call it first,
    before any JAX computation.

    Arguments not given come from ``jaxrec launch``'s environment (``JAXREC_COORDINATOR``,
    ``JAXREC_NUM_PROCESSES``, ``JAXREC_PROCESS_ID``), else from JAX's cluster detection
    (SLURM, Open MPI, Kubernetes-style environments). A peer that never connects fails
    this call after ``timeout_s`` seconds.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and ENV_NUM_PROCESSES in os.environ:
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and ENV_PROCESS_ID in os.environ:
        process_id = int(os.environ[ENV_PROCESS_ID])
    # CPU devices talk through gloo; without it a cross-process collective fails on CPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=timeout_s)


def launch(command: Sequence[str], num_processes: int, *, cpu_devices: int | None = None,
           gpus_per_process: int | None = None, timeout_s: float | None = None,
           port: int | None = None) -> int:
    """Runs ``command`` as ``num_processes`` processes on this machine, joined by
    ``initialize_distributed``; returns 0 when all succeed.

    ``command``: the program and its arguments (``["python", "train.py"]``; ``python``
    is this interpreter; ``["train", ...]`` is ``jaxrec train``, one run over every
    process's devices). ``cpu_devices``: CPU devices per process
    (``--xla_force_host_platform_device_count``); ``gpus_per_process``: process i sees GPUs
    ``i * k .. i * k + k - 1`` (``CUDA_VISIBLE_DEVICES``). The first process to fail stops the
    others, and so does ``timeout_s``: a dead or hung peer never hangs the launch; the
    message names the process.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    argv = list(command)
    if argv[:1] == ["jaxrec"]:
        argv = argv[1:]
    if argv[:1] == ["train"]:  # jaxrec train, as N processes of one run
        argv = ["python", "-m", "jaxrec", *argv]
    if not argv:
        raise ValueError("give the program to run, e.g. python train.py")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    coordinator = f"localhost:{port or _free_port()}"
    processes = []
    for rank in range(num_processes):
        env = dict(os.environ, **{ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                                  ENV_PROCESS_ID: str(rank)})
        if cpu_devices is not None:
            flags = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
        if gpus_per_process is not None:
            gpus = range(rank * gpus_per_process, (rank + 1) * gpus_per_process)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        processes.append(subprocess.Popen(argv, env=env, start_new_session=True))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A process that fails takes its peers' collectives down with it, so several
                # may have exited by now: all are named (the cause's own message is above).
                ranks = " and ".join(str(rank) for rank, _ in failed)
                exit_codes = " and ".join(str(c) for _, c in failed)
                print(f"jaxrec launch: process{'es' if len(failed) > 1 else ''} {ranks} of "
                      f"{num_processes} exited with code{'s' if len(failed) > 1 else ''} "
                      f"{exit_codes}; stopping the others", file=sys.stderr)
                return failed[0][1]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                running = [rank for rank, c in enumerate(codes) if c is None]
                print(f"jaxrec launch: processes {running} of {num_processes} still running after "
                      f"{timeout_s:g} s; stopping them", file=sys.stderr)
                return 124
            time.sleep(0.1)
    finally:
        _stop(processes)


def _stop(processes: list[subprocess.Popen]) -> None:
    """Stops every process still running (and its children): SIGTERM, then SIGKILL."""
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in processes:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """``jaxrec launch -n N [--cpu-devices K] [--timeout S] -- PROGRAM ...`` (PROGRAM
    ``train``: ``jaxrec train``)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="jaxrec launch", description="Run a command as N processes on this machine, joined by "
        "jax.distributed (jaxrec.parallel.initialize_distributed); see docs/multiprocess.md.")
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--cpu-devices", type=int, help="CPU devices per process")
    parser.add_argument("--gpus-per-process", type=int, help="GPUs per process (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--timeout", type=float, help="stop every process after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the program, e.g. python train.py, or train ... (jaxrec "
                        "train as N processes: one run over all their devices)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch(command, args.num_processes, cpu_devices=args.cpu_devices,
                      gpus_per_process=args.gpus_per_process, timeout_s=args.timeout)
    except ValueError as e:
        parser.error(str(e))
