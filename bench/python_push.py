"""1 GB from Python (TorchModuleSource, torch CPU bf16) against wtx push of a
synthetic model of the same bytes in C, to one worker over shm, steady state
(third sync of each), a worker each. Run by bench/python_push.sh."""
import subprocess
import sys
import time

import torch

import wtx

worker, c_worker, cli, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
n = 64
model = torch.nn.ParameterList(
    [torch.nn.Parameter(torch.randn(size // n // 2, dtype=torch.bfloat16)) for _ in range(n)])
client = wtx.WorkerClient([worker])
engine = wtx.TrainerEngine.trainer_init({"rank": 0, "transport": "shm"}, client=client,
                                        source=wtx.TorchModuleSource(model))
for _ in range(2):
    engine.send_weights()
t0 = time.time()
r = engine.send_weights()
py_wall = time.time() - t0
engine.shutdown()
for _ in range(2):
    subprocess.run([cli, "push", "--workers", c_worker, f"synthetic:{size}"], check=True,
                   capture_output=True)
t0 = time.time()
out = subprocess.run([cli, "push", "--workers", c_worker, f"synthetic:{size}"], check=True,
                     capture_output=True, text=True).stdout
c_wall = time.time() - t0
c_sync = float(out.split(" in ")[1].split(" s")[0])
print(f"python TorchModuleSource: {r['bytes']} bytes, sync {r['seconds']:.3f} s "
      f"(send_weights {py_wall:.3f} s)")
print(f"C wtx push synthetic:   sync {c_sync:.3f} s (process {c_wall:.3f} s)")
print(f"python / C sync time: {r['seconds'] / c_sync:.2f}")
