#!/usr/bin/env python3
"""Stand-alone reproduction of the gloo heap corruption that `fxsched.runtime.init_gloo` avoids.

    .venv/bin/python scripts/gloo_gathers_in_flight.py                # gloo as torch makes it (2 threads)
    .venv/bin/python scripts/gloo_gathers_in_flight.py --threads 1    # as fxsched.runtime makes it

Two spawned ranks keep `--depth` functional all-gathers in flight (launched back to back, then
waited), `--rounds` times, and check every gathered value. With torch 2.13 and gloo's default
two worker threads a rank usually dies (glibc "malloc(): unaligned tcache chunk detected", or
SIGSEGV); with one thread it does not. Only torch is imported, so the script can go with a
report upstream, and tells when a torch release no longer needs the workaround.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (16, 48, 544, 1024, 7)


def _gloo(threads):
    def create(common, _options):
        options = dist.ProcessGroupGloo._Options()
        options._threads = threads
        options._timeout = common.timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(common.store, common.group_rank, common.group_size, options)

    return create


def _rank(rank, world_size, store_path, threads, rounds, depth):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    if threads is None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    else:
        dist.Backend.register_backend("gloo_threads", _gloo(threads), extended_api=True, devices=["cpu"])
        dist.init_process_group("gloo_threads", store=store, rank=rank, world_size=world_size)
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    shards = [torch.arange(n, dtype=torch.float32) + 1000 * rank for n in SIZES]
    expected = [torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world_size)])
                for n in SIZES]
    for _ in range(rounds):
        launched = [c10d.all_gather_into_tensor(shards[i % len(SIZES)], world_size, group) for i in range(depth)]
        torch.randn(64, 64) @ torch.randn(64, 64)
        for i, out in enumerate(launched):
            if not torch.equal(c10d.wait_tensor(out), expected[i % len(SIZES)]):
                raise AssertionError(f"rank {rank}: gather {i} is wrong")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="gloo worker threads (default: gloo's own, 2)")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--depth", type=int, default=4, help="all-gathers in flight")
    args = parser.parse_args()
    store_path = os.path.join(tempfile.mkdtemp(prefix="gloo-repro-"), "store")
    ctx = mp.start_processes(_rank, args=(2, store_path, args.threads, args.rounds, args.depth), nprocs=2,
                             join=False, start_method="spawn")
    while not ctx.join():
        pass
    print(f"torch {torch.__version__}: {args.rounds} rounds of {args.depth} all-gathers in flight, "
          f"gloo threads {args.threads or 'default'}: no rank failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
