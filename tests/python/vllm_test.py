"""wtx as a vLLM 0.33 weight-transfer backend, against the real vllm package
(CPU only: VllmConfig cannot be built without a GPU, so a small, clearly
named stand-in carries vLLM's real ParallelConfig): the plugin entry point
registers "wtx" in both factories; the trainer factory returns a real
TrainerWeightTransferEngine that pushes vLLM's own ModuleSource; the
engine factory creates a real WeightTransferEngine that receives the JSON
form of wtx.v1 messages over the data plane and loads through the model's
load_weights, keeping the weights when an update fails. Run by vllm.sh."""
import os
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


class ShardedTrainerTest(unittest.TestCase):
    def test_vllms_factory_and_module_source_send_each_ranks_dtensor_parts(self):
        # vLLM's trainer factory with vLLM's ModuleSource over a module whose
        # weights are DTensors (2 processes, gloo): each rank sends its own
        # parts (many senders) to two tensor-parallel hosts.
        from package_test import dtensor_sync
        dtensor_sync(self, "vllm")

    def test_vllms_factory_sends_sparse_patches_from_rank_0(self):
        # send_weights with vLLM's SparseWeightPatch list on both ranks of
        # that trainer, as vLLM's sparse_nccl trainer is called: rank 0
        # sends them, each host the element in its slice.
        from package_test import dtensor_sync
        dtensor_sync(self, "vllm", "caller")


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


class EngineClientStandIn:
    """STAND-IN for vLLM's EngineClient (AsyncLLM needs a GPU): what the RL
    router calls, forwarded to a WtxWeightTransferEngine from vLLM's factory,
    as vLLM's worker does, off the event loop."""

    def __init__(self, engine):
        self.engine = engine
        self.version = None

    async def init_weight_transfer_engine(self, request):
        import asyncio
        await asyncio.to_thread(lambda: self.engine.init_transfer_engine(
            self.engine.parse_init_info(request.init_info)))

    async def start_weight_update(self):
        import asyncio
        await asyncio.to_thread(self.engine.start_weight_update)

    async def update_weights(self, request):
        import asyncio
        await asyncio.to_thread(self.engine.update_weights, request.update_info)

    async def finish_weight_update(self, weight_version=None):
        import asyncio
        await asyncio.to_thread(self.engine.finish_weight_update, weight_version)
        if weight_version is not None:
            self.version = weight_version

    async def get_weight_version(self):
        return self.version


class AppServer:
    """A FastAPI app of routers with client as its engine client, served by
    uvicorn on a loopback port in a thread: .url, .stop()."""

    def __init__(self, routers, client):
        import threading
        import uvicorn
        from fastapi import FastAPI
        app = FastAPI()
        for r in routers:
            app.include_router(r)
        app.state.engine_client = client
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def behind_routes(model):
    """(engine, app): vLLM's engine factory's wtx engine for model, behind
    vLLM's real RL router on FastAPI (app.url)."""
    from vllm.entrypoints.rl.online.api_router import router
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    engine = engine_for(model)
    return engine, AppServer([router], EngineClientStandIn(engine))


class HttpTest(unittest.TestCase):
    """vLLM's real RL router on FastAPI, in front of the wtx engine; the
    trainer uses vLLM's real HTTPVLLMWeightSyncClient, ModuleSource and
    trainer factory."""

    @classmethod
    def setUpClass(cls):
        cls.model = with_load_weights(tiny_llama(1))
        cls.engine, cls.app = behind_routes(cls.model)
        cls.url = cls.app.url

    @classmethod
    def tearDownClass(cls):
        cls.app.stop()
        cls.engine.shutdown()

    def test_vllms_http_client_pushes_over_shm_and_tcp(self):
        import requests
        import wtx
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        trainer = tiny_llama(0)
        client = HTTPVLLMWeightSyncClient(self.url, timeout=60)
        for step, transport in enumerate(["shm", "tcp"]):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.5 * (step + 1))
            engine = WeightTransferTrainerFactory.trainer_init(
                wtx.WtxTrainerInitInfo(transport=transport, rank=0), client=client,
                source=ModuleSource(trainer))
            engine.send_weights(version=f"http-{step}")
            engine.shutdown()
            for n, p in self.model.named_parameters():
                self.assertTrue(torch.equal(dict(trainer.named_parameters())[n].detach(),
                                            p.detach()), n)
            with torch.no_grad():
                self.assertTrue(torch.equal(trainer(PROMPT).logits, self.model(PROMPT).logits))
            self.assertEqual(f"http-{step}",
                             requests.get(f"{self.url}/weight_info").json()["weight_version"])

    def test_a_delta_through_vllms_routes_is_fenced_by_its_base(self):
        # vLLM's start carries no request: the trainer names the delta's base
        # in an UpdateInfo right after it, and the engine starts against it.
        # A new trainer cannot ask vLLM what it serves, so its first sync is
        # whole; after another trainer published there, the base is refused
        # and the same sync sends the whole model.
        import wtx
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        client = HTTPVLLMWeightSyncClient(self.url, timeout=60)
        trainer = tiny_llama(2)
        n = len(list(trainer.parameters()))
        engine = WeightTransferTrainerFactory.trainer_init(
            wtx.WtxTrainerInitInfo(transport="shm", rank=0, delta=True), client=client,
            source=ModuleSource(trainer))
        r = engine.send_weights(version="d-1")
        self.assertFalse(r["delta"])
        self.assertTrue(r["full_reason"])
        _, p = next(iter(trainer.named_parameters()))

        def step(version):
            with torch.no_grad():
                p[0].add_(1.0)
            r = engine.send_weights(version=version)
            for name, q in self.model.named_parameters():
                self.assertTrue(torch.equal(dict(trainer.named_parameters())[name].detach(),
                                            q.detach()), name)
            return r
        r = step("d-2")
        self.assertTrue(r["delta"], r["full_reason"])
        self.assertEqual(1, r["params"])
        self.assertEqual(n - 1, r["skipped_params"])
        other = WeightTransferTrainerFactory.trainer_init(
            wtx.WtxTrainerInitInfo(transport="shm", rank=0), client=client,
            source=ModuleSource(tiny_llama(3)))
        other.send_weights(version="other")
        other.shutdown()
        r = step("d-3")
        self.assertFalse(r["delta"])
        self.assertIn("update_weights", r["full_reason"])
        self.assertEqual(n, r["params"])
        r = step("d-4")
        self.assertTrue(r["delta"], r["full_reason"])
        self.assertEqual(1, r["params"])
        engine.shutdown()

    def test_a_failed_load_reaches_the_trainer_and_the_weights_stay(self):
        import wtx
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        wrong = wtx.DictSource({"not.a.parameter": torch.ones(3)})
        engine = WeightTransferTrainerFactory.trainer_init(
            wtx.WtxTrainerInitInfo(transport="shm", rank=0),
            client=HTTPVLLMWeightSyncClient(self.url, timeout=60), source=wrong)
        # A model with load_weights maps checkpoint names itself, so an
        # unknown name is found when loading: the finish fails (vLLM's route
        # answers 500) and the trainer's error says which call.
        with self.assertRaisesRegex(wtx.WtxError, "finish_weight_update: HTTPError: 500"):
            engine.send_weights()
        engine.shutdown()
        for n, p in self.model.named_parameters():
            self.assertTrue(torch.equal(before[n], p.detach()), n)


def http_trainer(url, source, **kw):
    """vLLM's trainer factory over vLLM's HTTP client to url, on shm."""
    import wtx
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    return WeightTransferTrainerFactory.trainer_init(
        wtx.WtxTrainerInitInfo(transport="shm", rank=0, **kw),
        client=HTTPVLLMWeightSyncClient(url, timeout=60), source=source)


def norm_patch():
    """vLLM's SparseWeightPatch of element 0 of tiny_llama's final norm."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch
    return SparseWeightPatch("model.norm.weight", torch.tensor([0]), torch.tensor([9.0]), (64,))


class HttpPatchesTest(unittest.TestCase):
    """Patches through vLLM's routes: the engine started with
    WTX_VLLM_KEEP_BASE=1 keeps what load_weights was last given and takes
    patches; vLLM's start answers nothing, so the trainer is told
    (engines_take_patches)."""

    @classmethod
    def setUpClass(cls):
        cls.model = with_load_weights(tiny_llama(4))
        cls.engine, cls.app = behind_routes(cls.model)
        os.environ["WTX_VLLM_KEEP_BASE"] = "1"
        try:  # the engine reads it at its first init, made here
            cls.engine.init_transfer_engine(cls.engine.parse_init_info({"shm": {}}))
        finally:
            del os.environ["WTX_VLLM_KEEP_BASE"]

    @classmethod
    def tearDownClass(cls):
        cls.app.stop()
        cls.engine.shutdown()

    def assert_holds(self, model, want):
        """Every parameter of model equals want's (a module, or a dict)."""
        want = want if isinstance(want, dict) else dict(want.named_parameters())
        for n, p in model.named_parameters():
            self.assertTrue(torch.equal(want[n].detach(), p.detach()), n)

    def test_deltas_and_the_callers_patches_arrive_as_patches(self):
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch
        import wtx
        trainer = tiny_llama(5)
        engine = http_trainer(self.app.url, ModuleSource(trainer), delta="patches",
                              engines_take_patches=True)
        # A new trainer cannot ask vLLM what it serves, so it has no base
        # for the caller's patches yet: refused before any call.
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        with self.assertRaisesRegex(wtx.WtxError, "send the whole model first"):
            engine.send_weights([norm_patch()])
        self.assert_holds(self.model, before)
        self.assertFalse(engine.send_weights(version="p-1")["delta"])
        self.assert_holds(self.model, trainer)
        name = "model.layers.0.mlp.gate_proj.weight"
        w = dict(trainer.named_parameters())[name]
        with torch.no_grad():
            w.view(-1)[[3, 700]] += 1.0
        r = engine.send_weights(version="p-2")
        self.assertTrue(r["delta"], r["full_reason"])
        self.assertEqual((1, 1), (r["params"], r["patched_params"]))
        self.assertLess(r["bytes"], w.numel() * w.element_size() // 10)
        self.assert_holds(self.model, trainer)
        # vLLM's sparse_nccl shape, NaN included: load_weights gets the
        # patched tensor whole, bit-exact.
        idx = torch.tensor([900, 5])
        vals = torch.tensor([float("nan"), -2.5])
        r = engine.send_weights([SparseWeightPatch(name, idx, vals, tuple(w.shape))],
                                version="p-3")
        self.assertEqual((1, 1), (r["params"], r["patched_params"]))
        want = w.detach().clone().view(-1)
        want[idx] = vals
        got = dict(self.model.named_parameters())[name].detach().view(-1)
        self.assertTrue(torch.equal(want.view(torch.int32), got.view(torch.int32)))
        engine.shutdown()

    def test_patches_to_an_engine_that_keeps_no_base_are_refused_and_the_weights_stay(self):
        from vllm.distributed.weight_transfer.base import ModuleSource
        import wtx
        model = with_load_weights(tiny_llama(6))
        plain, app = behind_routes(model)
        try:
            trainer = tiny_llama(7)
            engine = http_trainer(app.url, ModuleSource(trainer), engines_take_patches=True)
            engine.send_weights(version="q-1")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            # vLLM's route answers 500, its body not read by vLLM's client;
            # the engine's log says "this worker takes whole tensors only".
            with self.assertRaisesRegex(wtx.WtxError, "update_weights: HTTPError: 500"):
                engine.send_weights([norm_patch()], version="q-2")
            self.assert_holds(model, before)
            with torch.no_grad():
                trainer.model.norm.weight.add_(1.0)
            engine.send_weights(version="q-2")  # the next sync lands
            self.assert_holds(model, trainer)
            engine.shutdown()
            client = wtx.WorkerClient([plain._server.address])
            with self.assertRaisesRegex(ValueError, "engines_take_patches"):
                wtx.TrainerEngine.trainer_init({"rank": 0, "engines_take_patches": True},
                                               client=client)
            client.close()
        finally:
            app.stop()
            plain.shutdown()


class Ranks:
    """The processes of one tensor-parallel vLLM (vllm_tp_rank.py, vLLM's
    real LlamaForCausalLM at tensor_parallel_size world, gloo), each with
    its wtx engine, and a connection to each; every wait bounded."""

    TIMEOUT = 180

    def __init__(self, world):
        import socket
        import subprocess
        import sys
        import tempfile
        from multiprocessing.connection import Connection
        here = os.path.dirname(os.path.abspath(__file__))
        self.dir = tempfile.TemporaryDirectory()
        sock = socket.create_server(("127.0.0.1", 0))
        sock.settimeout(self.TIMEOUT)
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
        self.procs = [subprocess.Popen(
            [sys.executable, os.path.join(here, "vllm_tp_rank.py"), str(r), str(world),
             os.path.join(self.dir.name, "init"), addr]) for r in range(world)]
        self.conns = [None] * world
        try:
            for _ in range(world):
                c = Connection(sock.accept()[0].detach())
                _, rank = self._recv(c)
                self.conns[rank] = c
        finally:
            sock.close()

    def _recv(self, conn):
        if not conn.poll(self.TIMEOUT):
            raise TimeoutError("a tensor-parallel rank did not answer")
        return conn.recv()

    def ask(self, rank, *msg):
        self.conns[rank].send(msg)
        return self._recv(self.conns[rank])

    def close(self):
        for c in self.conns:
            if c is not None:
                c.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except Exception:  # noqa: BLE001
                p.kill()
        self.dir.cleanup()


class RanksEngineClientStandIn(EngineClientStandIn):
    """STAND-IN for vLLM's EngineClient of a tensor-parallel engine: each
    call goes to every rank's engine at once and returns once all have
    answered, failing if any failed (vLLM's collective_rpc)."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.version = None
        outer = self

        class Fan:
            def __getattr__(self, method):
                return lambda *args: outer.all(method, args)
        self.engine = Fan()

    def all(self, method, args):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(self.ranks.conns)) as pool:
            answers = list(pool.map(lambda r: self.ranks.ask(r, "call", method, list(args)),
                                    range(len(self.ranks.conns))))
        for a in answers:
            if a[0] != "ok":
                raise RuntimeError(a[1])

    async def init_weight_transfer_engine(self, request):
        import asyncio
        await asyncio.to_thread(self.all, "init_transfer_engine", [request.init_info])


def rank_slices(full, cfg, r, world):
    """What vLLM's LlamaForCausalLM at rank r of world holds of each of its
    parameters, made here from the full checkpoint tensors: q/k/v and
    gate/up rows of whole heads fused, o/down columns, the vocabulary
    padded to 64 and split evenly (its rows past the vocabulary zero),
    norms whole."""
    def rows(t):
        return t.chunk(world, 0)[r]

    def cols(t):
        return t.chunk(world, 1)[r]
    out = {}
    per = -(-cfg.vocab_size // 64) * 64 // world
    lo, hi = r * per, min((r + 1) * per, cfg.vocab_size)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = torch.zeros(per, cfg.hidden_size)
        part[:hi - lo] = full[name][lo:hi]
        out[name] = part
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [rows(full[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
        out[p + "self_attn.o_proj.weight"] = cols(full[p + "self_attn.o_proj.weight"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [rows(full[p + "mlp.gate_proj.weight"]), rows(full[p + "mlp.up_proj.weight"])])
        out[p + "mlp.down_proj.weight"] = cols(full[p + "mlp.down_proj.weight"])
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = full[p + n + ".weight"]
    out["model.norm.weight"] = full["model.norm.weight"]
    return out


# The trainer's chunk in TensorParallelTest: the model is many chunks.
CHUNK = 4 << 20


class TensorParallelTest(unittest.TestCase):
    """The plugin in a vLLM at tensor_parallel_size 2: vLLM's real
    LlamaForCausalLM in two processes (gloo), vLLM's real RL router in
    front of a stand-in engine client that fans each call out to both, and
    vLLM's HTTPVLLMWeightSyncClient, trainer factory and ModuleSource on
    the trainer side. Every rank gets every whole tensor (vLLM's routes
    give them the same messages; over tcp they relay them along a chain)
    and stages only its slices."""

    WORLD = 2

    @classmethod
    def setUpClass(cls):
        from vllm.entrypoints.rl.online.api_router import router
        from vllm.plugins import load_general_plugins
        from vllm_tp_rank import llama_config
        load_general_plugins()
        cls.cfg = llama_config()
        cls.ranks = Ranks(cls.WORLD)
        cls.app = AppServer([router], RanksEngineClientStandIn(cls.ranks))

    @classmethod
    def tearDownClass(cls):
        cls.app.stop()
        cls.ranks.close()

    def held(self, rank):
        """(XXH3-64 of each of rank's parameters, its staged_peak_bytes)."""
        answer = self.ranks.ask(rank, "params")
        self.assertEqual("ok", answer[0], answer)
        return answer[1], answer[2]

    def expect_slices(self, trainer):
        """Checks that every rank holds its slices of trainer's weights;
        yields (rank, its slices, its staged_peak_bytes)."""
        full = {n: p.detach() for n, p in trainer.named_parameters()}
        for r in range(self.WORLD):
            want = rank_slices(full, self.cfg, r, self.WORLD)
            sums, peak = self.held(r)
            self.assertEqual(sorted(want), sorted(sums))
            for name, t in want.items():
                self.assertEqual(xxhash.xxh3_64_intdigest(t.contiguous().numpy().tobytes()),
                                 sums[name], f"rank {r}: {name}")
            yield r, want, peak

    def test_a_delta_reaches_every_rank_which_keeps_its_slices_of_what_changed(self):
        # One row of q_proj in rank 1's heads and one of the embedding in
        # rank 0's vocabulary change: the delta sends those two tensors
        # whole, through the ranks' tcp chain; each rank fences on the base,
        # keeps its slices of both, and keeps what it holds of the rest.
        import wtx
        from transformers import LlamaForCausalLM
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        torch.manual_seed(1)
        trainer = LlamaForCausalLM(self.cfg).eval()
        engine = WeightTransferTrainerFactory.trainer_init(
            wtx.WtxTrainerInitInfo(transport="tcp", rank=0, buffer_size=CHUNK, delta=True),
            client=HTTPVLLMWeightSyncClient(self.app.url, timeout=120),
            source=ModuleSource(trainer))
        r = engine.send_weights(version="tp-d1")
        self.assertFalse(r["delta"])  # vLLM cannot say what it serves
        list(self.expect_slices(trainer))
        params = dict(trainer.named_parameters())
        with torch.no_grad():
            params["model.layers.0.self_attn.q_proj.weight"][400].add_(1.0)
            params["model.embed_tokens.weight"][7].add_(1.0)
        r = engine.send_weights(version="tp-d2")
        engine.shutdown()
        self.assertTrue(r["delta"], r["full_reason"])
        self.assertEqual(2, r["params"])
        list(self.expect_slices(trainer))

    def test_each_rank_stages_and_loads_only_its_slices(self):
        import wtx
        from transformers import LlamaForCausalLM
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        torch.manual_seed(0)
        trainer = LlamaForCausalLM(self.cfg).eval()
        model_bytes = sum(p.nbytes for p in trainer.parameters())
        client = HTTPVLLMWeightSyncClient(self.app.url, timeout=120)
        # shm: every rank reads the trainer's buffers; tcp: the ranks chain
        # behind the trainer's one upstream, each relaying to the next.
        for step, transport in enumerate(["shm", "tcp", "shm"]):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.25 * (step + 1))
            engine = WeightTransferTrainerFactory.trainer_init(
                wtx.WtxTrainerInitInfo(transport=transport, rank=0, buffer_size=CHUNK),
                client=client, source=ModuleSource(trainer))
            engine.send_weights(version=f"tp-{step}")
            engine.shutdown()
            for r, want, peak in self.expect_slices(trainer):
                # Its staging held its share, plus the whole tensors of the
                # chunks in flight, never the whole model.
                share = sum(t.nbytes for t in want.values())
                self.assertLessEqual(peak, share + 4 * CHUNK, f"rank {r}, {transport}")
                self.assertLess(peak, 0.6 * model_bytes, f"rank {r}, {transport}")
        # nccl's one peer would reach one rank: refused at init, by name.
        answer = self.ranks.ask(0, "call", "init_transfer_engine", [{"nccl": {}}])
        self.assertEqual("error", answer[0])
        self.assertIn("nccl reaches one rank", answer[1])


if __name__ == "__main__":
    unittest.main(verbosity=2)
