"""wtx as a vLLM 0.33 weight-transfer backend, against the real vllm package
(CPU only: VllmConfig cannot be built without a GPU, so a small, clearly
named stand-in carries vLLM's real ParallelConfig): the plugin entry point
registers "wtx" in both factories; the trainer factory returns a real
TrainerWeightTransferEngine that pushes vLLM's own ModuleSource; the
engine factory creates a real WeightTransferEngine that receives the JSON
form of wtx.v1 messages over the data plane and loads through the model's
load_weights, keeping the weights when an update fails. Run by vllm.sh."""
import os
import subprocess
import sys
import tempfile
import time
import unittest

import torch
import xxhash

from package_test import PROMPT, Worker, tiny_llama


def with_load_weights(model):
    """A transformers model with vLLM's loading entry point."""
    params = dict(model.named_parameters())

    def load_weights(weights):
        loaded = set()
        for name, t in weights:
            params[name].data.copy_(t)
            loaded.add(name)
        return loaded
    model.load_weights = load_weights
    return model


class VllmConfigStandIn:
    """STAND-IN for vllm.config.VllmConfig, which cannot be built without a
    GPU: only what WeightTransferEngine.__init__ reads, with vLLM's real
    ParallelConfig."""

    def __init__(self):
        from vllm.config.parallel import ParallelConfig
        self.parallel_config = ParallelConfig()
        self.model_config = None


def engine_for(model):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="wtx"), VllmConfigStandIn(), torch.device("cpu"), model)


class PluginTest(unittest.TestCase):
    def test_the_entry_point_registers_wtx_in_both_factories(self):
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory, WeightTransferTrainerFactory)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        self.assertIn("wtx", WeightTransferEngineFactory._registry)
        self.assertIn("wtx", WeightTransferTrainerFactory._registry)


class TrainerSideTest(unittest.TestCase):
    def setUp(self):
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        self.w = Worker()

    def tearDown(self):
        self.assertEqual(0, self.w.stop())

    def test_vllms_trainer_factory_and_module_source_push_over_wtx(self):
        import wtx
        from vllm.distributed.weight_transfer.base import ModuleSource, TrainerWeightTransferEngine
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        model = tiny_llama(0)
        client = wtx.WorkerClient([self.w.addr])
        engine = WeightTransferTrainerFactory.trainer_init(
            wtx.WtxTrainerInitInfo(transport="tcp", checksum="xxh3_64", rank=0), client=client,
            source=ModuleSource(model))
        self.assertIsInstance(engine, TrainerWeightTransferEngine)
        engine.send_weights()
        engine.shutdown()
        info = client.get_weight_info(include_params=True)[0]
        got = {p["meta"]["name"]: int(p["xxh3_64"]) for p in info["params"]}
        for name, p in model.named_parameters():
            self.assertEqual(xxhash.xxh3_64_intdigest(p.detach().numpy().tobytes()), got[name], name)
        client.close()


class WorkerSideTest(unittest.TestCase):
    """vLLM's engine factory with backend "wtx", driven as vLLM's RL routes
    drive it: dicts in, weights loaded into the model."""

    def setUp(self):
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        self.model = with_load_weights(tiny_llama(1))
        self.engine = engine_for(self.model)
        self.region = f"/wtx-vllmtest-{os.getpid()}"

    def tearDown(self):
        self.engine.shutdown()
        if os.path.exists("/dev/shm" + self.region):
            os.unlink("/dev/shm" + self.region)

    def chunk(self, tensors, corrupt=False):
        """The update_info dict of one shm chunk holding tensors."""
        data, params, sums = b"", [], []
        for name, t in tensors.items():
            raw = t.detach().contiguous().numpy().tobytes()
            params.append({"name": name, "dtype": "DTYPE_FLOAT32", "shape": list(t.shape)})
            sums.append(str(xxhash.xxh3_64_intdigest(raw)))
            data += raw
        with open("/dev/shm" + self.region, "wb") as f:
            f.write(bytes([data[0] ^ 1]) + data[1:] if corrupt else data)
        return {"params": params, "chunkBytes": str(len(data)), "xxh3_64": sums,
                "shm": {"region": self.region}}

    def test_an_update_in_json_lands_through_load_weights(self):
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
        self.assertIsInstance(self.engine, WeightTransferEngine)
        trainer = tiny_llama(0)
        params = dict(trainer.named_parameters())
        self.engine.init_transfer_engine(self.engine.parse_init_info({"shm": {}}))
        self.engine.start_weight_update()
        names = list(params)
        self.engine.update_weights(self.chunk({n: params[n] for n in names[:5]}))
        self.engine.update_weights([self.chunk({n: params[n] for n in names[5:]})])
        self.engine.finish_weight_update()
        for n, p in self.model.named_parameters():
            self.assertTrue(torch.equal(params[n].detach(), p.detach()), n)
        with torch.no_grad():
            self.assertTrue(torch.equal(trainer(PROMPT).logits, self.model(PROMPT).logits))

    def test_a_failed_update_keeps_the_weights_and_json_is_strict(self):
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        with self.assertRaisesRegex(ValueError, "bogus"):
            self.engine.parse_init_info({"shm": {}, "bogus": 1})
        with self.assertRaisesRegex(ValueError, "update_info"):
            self.engine.parse_update_info({"params": 7})
        self.engine.init_transfer_engine(self.engine.parse_init_info({"shm": {}}))
        self.engine.start_weight_update()
        name, p = next(iter(tiny_llama(5).named_parameters()))
        with self.assertRaisesRegex(Exception, "DATA_LOSS"):
            self.engine.update_weights(self.chunk({name: p}, corrupt=True))
        for n, q in self.model.named_parameters():
            self.assertTrue(torch.equal(before[n], q.detach()), n)

    def test_the_draft_target_loads_into_the_draft_model(self):
        draft = with_load_weights(tiny_llama(7))
        main_before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        src = dict(tiny_llama(0).named_parameters())
        self.engine.set_weight_update_target(draft, None)
        self.engine.init_transfer_engine(self.engine.parse_init_info({"shm": {}}))
        self.engine.start_weight_update()
        self.engine.update_weights(self.chunk(src))
        self.engine.finish_weight_update()
        self.engine.reset_weight_update_target()
        for n, p in draft.named_parameters():
            self.assertTrue(torch.equal(src[n].detach(), p.detach()), n)
        for n, p in self.model.named_parameters():
            self.assertTrue(torch.equal(main_before[n], p.detach()), n)


if __name__ == "__main__":
    unittest.main(verbosity=2)
