"""One tensor-parallel rank of vllm_test's TensorParallelTest, a process of
its own: vLLM's real LlamaForCausalLM built at tensor_parallel_size 2
(gloo, on CPU), with the wtx engine from vLLM's WeightTransferEngineFactory
loading into it. It takes the engine's calls over a connection, as vLLM's
worker takes them from collective_rpc.

    vllm_tp_rank.py RANK WORLD INIT_FILE ADDRESS(host:port of the test)

On the connection: ("call", method, args) runs engine.method(*args) (for
init_transfer_engine, on the dict parsed by the engine, as vLLM's worker
does) and
answers ("ok", None) or ("error", text); ("params",) answers ("ok",
{name: XXH3-64 of the parameter's bytes}, the host's staged_peak_bytes).

STAND-INS, for what a CPU build of vLLM cannot make: VllmConfig (it needs
a platform) is a class carrying vLLM's real ParallelConfig, CacheConfig,
AttentionConfig, CompilationConfig and KernelConfig and the model's
transformers config; the attention layer (it needs an attention backend)
is a module of no parameters. Neither takes part in loading weights.
"""
import os
import socket
import sys
from multiprocessing.connection import Connection

import torch
import xxhash


def llama_config():
    """The transformers config both sides build from: large enough that
    every sharded tensor is staged on its own (over 64 KiB). Layers: 8, or
    WTX_TP_LAYERS (bench/vllm_tp.sh sizes the model by it)."""
    from transformers import LlamaConfig
    layers = int(os.environ.get("WTX_TP_LAYERS", "8"))
    return LlamaConfig(vocab_size=4000, hidden_size=512, intermediate_size=1536,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=128, tie_word_embeddings=False)


def vllm_config_stand_in(hf, world):
    from vllm.config.attention import AttentionConfig
    from vllm.config.cache import CacheConfig
    from vllm.config.compilation import CompilationConfig
    from vllm.config.kernel import KernelConfig
    from vllm.config.parallel import ParallelConfig

    class ModelConfigStandIn:
        hf_config = hf
        hf_text_config = hf
        dtype = torch.float32

        def __getattr__(self, name):
            return None

    class VllmConfigStandIn:
        parallel_config = ParallelConfig(tensor_parallel_size=world)
        cache_config = CacheConfig()
        attention_config = AttentionConfig()
        compilation_config = CompilationConfig(custom_ops=["none"], mode=0)
        kernel_config = KernelConfig()
        model_config = ModelConfigStandIn()
        quant_config = None
        additional_config = {}

        def __getattr__(self, name):
            return None
    return VllmConfigStandIn()


class AttentionStandIn(torch.nn.Module):
    """STAND-IN for vLLM's Attention layer: no parameters, never run."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def main() -> None:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    host, port = sys.argv[4].rsplit(":", 1)
    from vllm.config import set_current_vllm_config
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins
    import vllm.model_executor.models.llama as llama

    config = vllm_config_stand_in(llama_config(), world)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=world, rank=rank, distributed_init_method=f"file://{init_file}",
            local_rank=rank, backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        llama.Attention = AttentionStandIn
        model = llama.LlamaForCausalLM(vllm_config=config)
    load_general_plugins()
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="wtx"), config, torch.device("cpu"), model)
    conn = Connection(socket.create_connection((host, int(port))).detach())
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "params":
            sums = {n: xxhash.xxh3_64_intdigest(p.detach().numpy().tobytes())
                    for n, p in model.named_parameters()}
            conn.send(("ok", sums, engine._server.staged_peak_bytes))
            continue
        try:
            args = msg[2]
            if msg[1] == "init_transfer_engine":  # as vLLM's worker: the dict parsed first
                args = [engine.parse_init_info(args[0])]
            conn.send(("ok", getattr(engine, msg[1])(*args)))
        except Exception as e:  # noqa: BLE001 (the error goes back to the test)
            conn.send(("error", f"{type(e).__name__}: {e}"))
    engine.shutdown()


if __name__ == "__main__":
    main()
