"""Same-run baseline for bench/run.sh: the control plane wtx replaces. One
vLLM-style JSON POST (names, dtypes, shapes of N parameters, as vLLM's
update_weights_from_distributed carries them) to a FastAPI route served by
uvicorn on loopback, which parses it into Python objects. Prints the best
seconds of seven POSTs per N, the statistic bench/run.sh takes for wtx's
steady-state syncs too (the best is the least disturbed by the other
processes on the machine; a median of five drifted by 1.6x between runs).
usage: json_baseline.py N [N...]"""
import json
import socket
import sys
import threading
import time
import urllib.request

import uvicorn
from fastapi import FastAPI, Request

app = FastAPI()


@app.post("/update_weights")
async def update_weights(request: Request):
    body = await request.json()
    # What the engine does first: walk every parameter's metadata.
    n = sum(1 for name, dtype, shape in zip(body["names"], body["dtype_names"],
                                            body["shapes"]) if name and dtype and shape)
    return {"params": n}


def main():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    for n in map(int, sys.argv[1:]):
        body = json.dumps({
            "names": [f"model.layers.{i // 100}.experts.{i % 100}.w" for i in range(n)],
            "dtype_names": ["float32"] * n,
            "shapes": [[4]] * n,
        }).encode()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/update_weights", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req) as resp:
                assert json.loads(resp.read())["params"] == n
            times.append(time.perf_counter() - t0)
        print(f"json_post {n} {min(times):.4f}")
    server.should_exit = True


if __name__ == "__main__":
    main()
