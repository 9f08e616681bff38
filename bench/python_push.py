"""The Python package against the C CLI, same bytes, same worker kind, same
run, steady state, a worker each. Run by bench/python_push.sh.
  BYTES: 1 GB from Python (TorchModuleSource, torch CPU bf16) against wtx
         push of a synthetic model of the same bytes, over shm, third sync;
         and that synthetic model pushed by the C CLI into a Python host
         (wtx.serve of a module whose load_weights copies into its own
         tensors, as vLLM's do) against the C worker, third sync
  tiny N PATH [EACH]: N tiny tensors (F32 [4], or F32 [EACH], as
         bench/tiny_model.py writes) from
         Python (TorchModuleSource of a ParameterList) against wtx push of
         that safetensors file, over shm, the best of syncs 3-7: the
         control plane, where Python's cost is per tensor; and the same
         file pushed by the C CLI into a Python host (wtx.serve of a module
         with load_weights, as vLLM's models have) in this process, against
         the C worker: the worker side of the vLLM integration; and into a
         host whose load_weights only walks its items, wtx's own part"""
import gc
import os
import subprocess
import sys
import time

import torch

import wtx

# bench/python_ab.sh: every sync's time too, and the garbage collector off
RAW = os.environ.get("WTX_BENCH_RAW") == "1"
if os.environ.get("WTX_BENCH_NO_GC") == "1":
    gc.disable()

worker, c_worker, cli = sys.argv[1], sys.argv[2], sys.argv[3]
tiny = sys.argv[4] == "tiny"
each = 4  # F32 elements a tensor (tiny)
if tiny:
    n, path = int(sys.argv[5]), sys.argv[6]
    each = int(sys.argv[7]) if len(sys.argv) > 7 else each
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(each)) for _ in range(n)])
    warm, rounds, flags = 2, 5, ["--buffer-size", "64M", path]
else:
    size = int(sys.argv[4])
    n = 64
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(size // n // 2, dtype=torch.bfloat16)) for _ in range(n)])
    warm, rounds, flags = 2, 1, [f"synthetic:{size}"]
client = wtx.WorkerClient([worker])
engine = wtx.TrainerEngine.trainer_init({"rank": 0, "transport": "shm"}, client=client,
                                        source=wtx.TorchModuleSource(model))
for _ in range(warm):
    engine.send_weights()
rounds = int(os.environ.get("WTX_BENCH_SYNCS", rounds))
py_sync = py_wall = 1e30
py_all = []
for _ in range(rounds):
    t0 = time.time()
    r = engine.send_weights()
    py_wall = min(py_wall, time.time() - t0)
    py_sync = min(py_sync, r["seconds"])
    py_all.append(r["seconds"])
engine.shutdown()
push = [cli, "push", "--workers", c_worker, *flags]


def cli_push(workers: str, every: list | None = None) -> tuple[float, float]:
    """The C CLI's best sync and process seconds to workers, after warm-up
    (every sync's seconds appended to every)."""
    cmd = push[:3] + [workers] + push[4:]
    for _ in range(warm):
        subprocess.run(cmd, check=True, capture_output=True)
    sync = wall = 1e30
    for _ in range(rounds):
        t0 = time.time()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        wall = min(wall, time.time() - t0)
        s = float(out.split(" in ")[1].split(" s")[0])
        sync = min(sync, s)
        if every is not None:
            every.append(s)
    return sync, wall


c_sync, c_wall = cli_push(c_worker)
what = (f"{n} tiny tensors" if each == 4 else f"{n} tensors of F32 [{each}]") if tiny \
    else f"{r['bytes']} bytes"
best = f", best of {rounds}" if rounds > 1 else ""
print(f"python TorchModuleSource: {what}, sync {py_sync:.3f} s (send_weights {py_wall:.3f} s{best})")
print(f"C wtx push:               sync {c_sync:.3f} s (process {c_wall:.3f} s{best})")
print(f"python / C sync time: {py_sync / c_sync:.2f}")


class Host(torch.nn.Module):
    """A model that loads by name, as vLLM's do: into tensors of its own,
    made on first sight (vLLM's exist before the first load)."""

    def __init__(self, names=()):
        super().__init__()
        self.weights = {name: torch.zeros(each) for name in names}

    def load_weights(self, items):
        for name, t in items:
            w = self.weights.get(name)
            if w is None:
                w = self.weights[name] = torch.empty_like(t)
            w.copy_(t)


names = [m.name for m in wtx.SafetensorsSource(path).metadata] if tiny else ()
host_all: list = []
with wtx.serve(Host(names), "127.0.0.1:0") as server:
    host_sync, _ = cli_push(server.address, host_all)
print(f"C wtx push into a Python host (wtx.serve, load_weights): sync {host_sync:.3f} s "
      f"= {host_sync / c_sync:.2f} x the C worker's{best}")


class Walker(Host):
    """The same host whose load_weights only walks what it is given: wtx's
    own part of a sync into a Python host, without the model's copies."""

    def load_weights(self, items):
        for _ in items:
            pass


walk_all: list = []
with wtx.serve(Walker(names), "127.0.0.1:0") as server:
    walk_sync, _ = cli_push(server.address, walk_all)
if RAW:  # bench/python_ab.sh: every sync of the sides above
    for what, v in (("host", host_all), ("walking", walk_all), ("trainer", py_all)):
        print(f"raw {what}:", " ".join(f"{x:.4f}" for x in v))
else:
    print(f"  the same, load_weights only walking its items (wtx's own part): sync "
          f"{walk_sync:.3f} s = {walk_sync / c_sync:.2f} x the C worker's{best}")
