"""The vLLM plugin in a tensor-parallel vLLM against the same plugin in a
vLLM of one rank, same model, same run. Run by bench/vllm_tp.sh.

Each side is vllm_test's harness: vLLM's real LlamaForCausalLM (in
tests/python/vllm_tp_rank.py processes, gloo on CPU) behind vLLM's real RL
router, a stand-in engine client fanning each route out to the ranks as
collective_rpc does, and vLLM's HTTPVLLMWeightSyncClient and trainer
factory on the trainer side. Per way: the best of SYNCS syncs of one
trainer (each after the first: the ranks have learned what their loaders
read), and each rank's staged_peak_bytes against the model's bytes. The
ways: shm and tcp at the trainer's defaults through a control plane (64
MiB chunks), and shm in the 4 MiB x 4 buffers shm asks for on its own,
each chunk then one more HTTP request.

    vllm_tp.py LAYERS SYNCS"""
import os
import sys
import time

import torch

import vllm_test
import vllm_tp_rank


# way: (transport, buffer_size, num_buffers), 0: the trainer's default
WAYS = {"shm": ("shm", 0, 0), "tcp": ("tcp", 0, 0), "shm 4 MiB": ("shm", 4 << 20, 4)}


def measure(world: int, syncs: int) -> dict:
    """{way: (best sync s, [peak bytes per rank])} for a vLLM of world ranks."""
    import wtx
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.entrypoints.rl.online.api_router import router
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    cfg = vllm_tp_rank.llama_config()
    torch.manual_seed(0)
    trainer = LlamaForCausalLM(cfg).eval()
    ranks = vllm_test.Ranks(world)
    app = vllm_test.AppServer([router], vllm_test.RanksEngineClientStandIn(ranks))
    out = {}
    try:
        for way, (transport, size, n) in WAYS.items():
            engine = WeightTransferTrainerFactory.trainer_init(
                wtx.WtxTrainerInitInfo(transport=transport, rank=0, buffer_size=size,
                                       num_buffers=n),
                client=HTTPVLLMWeightSyncClient(app.url, timeout=300),
                source=ModuleSource(trainer))
            best = 1e30
            for _ in range(syncs):
                t0 = time.perf_counter()
                engine.send_weights()
                best = min(best, time.perf_counter() - t0)
            engine.shutdown()
            out[way] = (best, [ranks.ask(r, "params")[2] for r in range(world)])
    finally:
        app.stop()
        ranks.close()
    return out


def main() -> None:
    layers, syncs = int(sys.argv[1]), int(sys.argv[2])
    os.environ["WTX_TP_LAYERS"] = str(layers)  # the rank processes build from it too
    from transformers import LlamaForCausalLM
    model_bytes = sum(p.nbytes for p in LlamaForCausalLM(vllm_tp_rank.llama_config()).parameters())
    one, two = measure(1, syncs), measure(2, syncs)
    print(f"model: vllm_tp_rank.llama_config() with {layers} layers, {model_bytes / 1e6:.1f} MB "
          f"(fp32); best of {syncs} syncs of one trainer; peaks of staged bytes per rank")
    for t in WAYS:
        print(f"{t}: TP 1 sync {one[t][0]:.3f} s, staged peak {one[t][1][0] / model_bytes:.2f}x "
              f"the model | TP 2 sync {two[t][0]:.3f} s = {two[t][0] / one[t][0]:.2f}x TP 1's, "
              "staged peaks " + ", ".join(f"{p / model_bytes:.2f}x" for p in two[t][1]))
    print(f"shm in 64 MiB chunks against 4 MiB: {one['shm'][0] / one['shm 4 MiB'][0]:.2f}x "
          f"the time at TP 1, {two['shm'][0] / two['shm 4 MiB'][0]:.2f}x at TP 2")


if __name__ == "__main__":
    main()
