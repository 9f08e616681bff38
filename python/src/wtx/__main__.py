"""``python -m wtx push|info``: the CLI's two everyday commands from Python.

    python -m wtx push --workers H:P[,H:P] [--backend shm|tcp|cuda_ipc|nccl]
                       [--version V] [--token T] FILE.safetensors...
    python -m wtx info H:P [--params] [--token T]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import SafetensorsSource, TrainerEngine, WorkerClient, WtxError, WtxTrainerInitInfo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wtx", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    push = sub.add_parser("push", help="one weight sync of safetensors files to every worker")
    push.add_argument("--workers", required=True, help="host:port[,host:port...]")
    push.add_argument("--backend", default="shm", choices=["shm", "tcp", "cuda_ipc", "nccl"])
    push.add_argument("--version", default=None, help="weight version label")
    push.add_argument("--timeout-ms", type=int, default=0)
    push.add_argument("files", nargs="+")
    info = sub.add_parser("info", help="a worker's session state and published weights")
    info.add_argument("address")
    info.add_argument("--params", action="store_true", help="also list the parameters")
    for s in (push, info):
        s.add_argument("--token", default=os.environ.get("WTX_TOKEN"),
                       help="bearer token (default: $WTX_TOKEN)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "info":
            with WorkerClient(a.address, token=a.token) as c:
                print(json.dumps(c.get_weight_info(include_params=a.params)[0], indent=2))
            return 0
        client = WorkerClient(a.workers.split(","), token=a.token)
        engine = TrainerEngine.trainer_init(
            WtxTrainerInitInfo(transport=a.backend, timeout_ms=a.timeout_ms, rank=0),
            client=client, source=SafetensorsSource(a.files))
        r = engine.send_weights(version=a.version)
        engine.shutdown()
        print(f"pushed {r['params']} params, {r['bytes']} bytes to {len(client.addresses)} "
              f"worker(s) over {a.backend} in {r['seconds']:.3f} s, version {r['version']}")
        return 0
    except (WtxError, ValueError) as e:
        print(f"wtx: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
