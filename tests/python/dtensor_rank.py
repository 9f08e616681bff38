"""One trainer rank of package_test's DTensor test, a process of its own:
its module's weights are DTensors sharded Shard(0) over 2 ranks (gloo, on
CPU), and TorchModuleSource hands wtx each rank's own part (to_local), so
the sync gathers nothing.

    dtensor_rank.py RANK INIT_FILE HOSTS(comma) RANK_ADDRESSES(comma) [vllm] [MODE]

"vllm": through vLLM's own trainer factory and ModuleSource instead of
TorchModuleSource (with "caller" too: vLLM's SparseWeightPatch). "delta": a delta trainer; after dt-1, element [0, 0] of
rank 1's shard of col.weight (row 4 of the full tensor) grows by 1 and
dt-2 is sent; "patches": the same with delta="patches"; "patches-both":
that, with element [0, 0] of rank 0's shard (row 0) grown by 1 too;
"caller": after dt-1 every rank calls send_weights(patches) with the
caller's patches of col.weight's elements [0, 0] and [4, 0] grown by 1
(vLLM's sparse_nccl shape), sent as dt-2 by rank 0 alone. Prints the last
send_weights result as JSON."""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import wtx
from package_test import tp_weights


def main() -> None:
    rank, init_file = int(sys.argv[1]), sys.argv[2]
    hosts, addrs = sys.argv[3].split(","), sys.argv[4].split(",")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full, _ = tp_weights()
    model = torch.nn.Module()
    model.col = torch.nn.Linear(4, 8, bias=False)
    model.row = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(4))
    for name, p in list(model.named_parameters()):
        owner, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(owner, leaf, torch.nn.Parameter(distribute_tensor(full[name], mesh, [Shard(0)])))
    client = wtx.WorkerClient(hosts)
    mode = "".join(sys.argv[5:])
    delta = {"delta": True, "patches": "patches", "patches-both": "patches"}.get(mode, False)
    info = wtx.WtxTrainerInitInfo(transport="tcp", rank=rank, world_size=2, timeout_ms=15000,
                                  rank_addresses=addrs,
                                  session_token="python-dtensor-session-token", delta=delta)
    if "vllm" in sys.argv[5:]:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # registers "wtx", as vLLM does at start
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                           source=ModuleSource(model))
    else:
        engine = wtx.TrainerEngine.trainer_init(info, client=client,
                                                source=wtx.TorchModuleSource(model))
    result = engine.send_weights(version="dt-1")
    if "caller" in sys.argv[5:]:
        values = full["col.weight"].reshape(-1)[[0, 16]] + 1
        patch = {"name": "col.weight", "indices": torch.tensor([16, 0]),
                 "values": values.flip(0), "full_shape": (8, 4)}
        if "vllm" in sys.argv[5:]:  # vLLM's own patch type
            from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch
            patch = SparseWeightPatch(**patch)
        result = engine.send_weights([patch], version="dt-2")
    if delta:
        with torch.no_grad():
            if rank == 1 or mode == "patches-both":
                model.col.weight.to_local()[0, 0] += 1
        result = engine.send_weights(version="dt-2")
    engine.shutdown()
    client.close()
    print(json.dumps({k: result[k] for k in ("bytes", "version", "delta", "params",
                                             "patched_params")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
