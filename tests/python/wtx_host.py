"""An inference host for the package's tests: a small Llama (transformers,
built from a config, random weights from --seed: no download) served with
wtx.serve. Commands on stdin, one per line:
  state PATH   saves {"params": state_dict, "logits": logits of a fixed
               prompt, "version": Server.version, "loaded": the names
               load_weights was given} to PATH with torch.save
  quit         closes the server and exits 0
The port goes to --port-file once serving."""
import argparse
import sys

import torch

import wtx
from package_test import PROMPT, tiny_llama


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--port-file", required=True)
    p.add_argument("--loader", action="store_true", help="serve through model.load_weights")
    p.add_argument("--keep-base", action="store_true", help="wtx.serve(keep_base=True)")
    a = p.parse_args()
    model = tiny_llama(a.seed)
    loaded = []  # the names load_weights was given, in order
    if a.loader:  # as vLLM models do: load_weights(iterable of (name, tensor))
        params = dict(model.named_parameters())

        def load_weights(weights):
            for name, t in weights:
                params[name].data.copy_(t)
                loaded.append(name)
        model.load_weights = load_weights
    pauses = []
    with wtx.serve(model, "127.0.0.1:0", on_pause=lambda w: pauses.append(w),
                   on_resume=lambda: pauses.append("resume"), keep_base=a.keep_base) as server:
        with open(a.port_file + ".tmp", "w") as f:
            f.write(str(server.port))
        import os
        os.rename(a.port_file + ".tmp", a.port_file)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "state":
                with torch.no_grad():
                    logits = model(PROMPT).logits
                torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
                            "logits": logits, "version": server.version, "pauses": pauses,
                            "loaded": loaded},
                           cmd[1])
                print("ok", flush=True)
            elif cmd[0] == "quit":
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
