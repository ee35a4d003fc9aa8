#!/usr/bin/env python
"""Start Ray across a Slurm allocation, run a driver command on it, tear Ray down.

    python slurm/ray_bootstrap.py --gpus-per-node 8 [--deadline-s 300] [--port P] -- CMD ARGS...

Run it once per allocation, on the first node (in the batch script, not under srun): a Ray
head there, a worker on every other node (srun), a wait until every node and its GPUs have
joined (deadline, clear failure), then CMD with RAY_ADDRESS set; exit status = CMD's. Ray is
stopped on every exit path. With --gpus-per-node 0 it runs a CPU-only Ray (one-node tests).
The logic lives in fp8rl.backends.openrlhf.ray_cluster.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from fp8rl.backends.openrlhf.ray_cluster import RayBootstrapError, bootstrap

    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    else:
        command = []
    p = argparse.ArgumentParser(prog="ray_bootstrap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs every node must bring")
    p.add_argument("--deadline-s", type=float, default=300.0, help="give up if Ray is not complete by then")
    p.add_argument("--port", type=int, default=None, help="GCS port of the head (default: a free one)")
    args = p.parse_args(argv)
    if not command:
        p.error("give the driver command after '--'")
    try:
        return bootstrap(command, gpus_per_node=args.gpus_per_node, port=args.port, deadline_s=args.deadline_s)
    except RayBootstrapError as e:
        print(f"ray_bootstrap: error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
