"""The sidecar bridge (wtx-worker --vllm-url) into a stock vLLM, against
vLLM's real RL and dev-rpc routers on FastAPI. Their engine client is a
clearly named stand-in (AsyncLLM needs a GPU) whose collective_rpc
("reload_weights", weights_path=DIR/<version>) loads the directory's
safetensors into a transformers model, as vLLM's default loader would.
Checked: the weights and logits after a push, the version vLLM reports,
pause and resume around the reload and forwarded from the trainer, and
each failure path (vLLM refusing, too slow, down) as the trainer's error
with the model unchanged. Run by vllm.sh (WTX_VLLM_PYTHON)."""
import asyncio
import os
import tempfile
import time
import unittest

import torch

from package_test import PROMPT, Worker, tiny_llama
from vllm_test import AppServer


class EngineClientStandIn:
    """STAND-IN for vLLM's EngineClient: what the RL and dev-rpc routers
    call. reload_weights reads DIR/model.safetensors with the safetensors
    package into the model. fail / delay_s make it refuse or dawdle;
    fail_times refuses that many reloads, then loads again."""

    def __init__(self, model):
        self.model = model
        self.version = None
        self.calls = []
        self.fail = False
        self.fail_times = 0
        self.delay_s = 0.0

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, dict(kwargs or {})))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail or self.fail_times > 0:
            self.fail_times = max(0, self.fail_times - 1)
            raise RuntimeError("reload_weights refused by the stand-in")
        from safetensors.torch import load_file
        tensors = load_file(os.path.join(kwargs["weights_path"], "model.safetensors"))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        return [None]

    async def update_weight_version(self, version):
        self.version = version

    # Newer vLLM's "disk" weight-transfer backend, as the RL routes reach it.
    async def start_weight_update(self):
        self.calls.append(("start_weight_update",))

    async def update_weights(self, request):
        info = request.update_info
        self.calls.append(("update_weights", dict(info)))
        await self.collective_rpc("reload_weights", kwargs={"weights_path": info["weights_path"]})

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish_weight_update", weight_version))
        self.version = weight_version

    async def get_weight_version(self):
        return self.version


def FakeVllm(client):
    """vLLM's real RL and dev-rpc routers in front of client, served."""
    from vllm.entrypoints.rl.online.api_router import router as rl
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc
    return AppServer([rl, rpc], client)


def Sidecar(url, timeout_ms=20000, disk=False):
    """wtx-worker --vllm-url URL --vllm-dir DIR; DIR is .vdir."""
    vdir = tempfile.mkdtemp(prefix="wtx-sidecar-") + "/versions"
    w = Worker("--vllm-url", url, "--vllm-dir", vdir, "--vllm-timeout-ms", str(timeout_ms),
               *(["--vllm-disk"] if disk else []))
    w.vdir = vdir
    return w


def push(addr, model, version):
    """A sync of model to addr (one worker, or a list of replicas)."""
    import wtx
    client = wtx.WorkerClient(addr if isinstance(addr, list) else [addr])
    engine = wtx.TrainerEngine.trainer_init(
        {"rank": 0, "transport": "shm"}, client=client,
        source=wtx.DictSource({n: p.detach() for n, p in model.named_parameters()}))
    try:
        return engine.send_weights(version=version)
    finally:
        engine.shutdown()
        client.close()


class SidecarTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama(1)
        cls.client = EngineClientStandIn(cls.model)
        cls.vllm = FakeVllm(cls.client)

    @classmethod
    def tearDownClass(cls):
        cls.vllm.stop()

    def setUp(self):
        self.client.fail = False
        self.client.fail_times = 0
        self.client.delay_s = 0.0
        self.client.calls.clear()

    def weights(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def test_a_push_reaches_vllm_through_a_reload_between_pause_and_resume(self):
        import requests
        import wtx
        side = Sidecar(self.vllm.url)
        try:
            trainer = tiny_llama(0)
            push(side.addr, trainer, "step-1")
            for n, p in self.model.named_parameters():
                self.assertTrue(torch.equal(dict(trainer.named_parameters())[n].detach(), p), n)
            with torch.no_grad():
                self.assertTrue(torch.equal(trainer(PROMPT).logits, self.model(PROMPT).logits))
            self.assertEqual(["pause", "reload_weights", "resume"],
                             [c[0] for c in self.client.calls])
            self.assertEqual(("pause", "wait"), self.client.calls[0])
            self.assertEqual({"weights_path": os.path.join(side.vdir, "step-1")},
                             self.client.calls[1][1])
            self.assertTrue(os.path.exists(os.path.join(side.vdir, "step-1", "model.safetensors")))
            self.assertEqual("step-1", requests.get(self.vllm.url + "/weight_info").json()
                             ["weight_version"])
            with wtx.WorkerClient(side.addr) as c:
                info = c.get_weight_info()[0]
                self.assertEqual("step-1", info["serving_version"])
                self.client.calls.clear()
                c.pause(wait_for_inflight=False)  # forwarded to vLLM
                c.resume()
            self.assertEqual([("pause", "abort"), ("resume",)], self.client.calls)
            # Two more versions: the oldest directory goes (two are kept).
            for v in ("step-2", "step-3"):
                push(side.addr, trainer, v)
            self.assertEqual(["step-2", "step-3"], sorted(os.listdir(side.vdir)))
        finally:
            self.assertEqual(0, side.stop())

    def test_a_push_while_the_trainer_paused_vllm_leaves_it_paused(self):
        # A reload pauses around itself; it must not resume what the
        # trainer paused: that stays paused until the trainer resumes it.
        import wtx
        side = Sidecar(self.vllm.url)
        try:
            with wtx.WorkerClient(side.addr) as c:
                self.assertEqual([True], c.pause(wait_for_inflight=True))
                push(side.addr, tiny_llama(10), "held")
                self.assertEqual(["pause", "pause", "reload_weights"],
                                 [x[0] for x in self.client.calls])
                self.assertEqual([False], c.resume())
            self.assertEqual(("resume",), self.client.calls[-1])
            push(side.addr, tiny_llama(11), "free")  # not paused: resumed after
            self.assertEqual(("resume",), self.client.calls[-1])
        finally:
            self.assertEqual(0, side.stop())

    def test_the_disk_backend_path_loads_through_the_rl_routes(self):
        side = Sidecar(self.vllm.url, disk=True)
        try:
            trainer = tiny_llama(6)
            push(side.addr, trainer, "disk-1")
            for n, p in self.model.named_parameters():
                self.assertTrue(torch.equal(dict(trainer.named_parameters())[n].detach(), p), n)
            self.assertEqual(["start_weight_update", "update_weights", "reload_weights",
                              "finish_weight_update"], [c[0] for c in self.client.calls])
            self.assertEqual({"weights_path": os.path.join(side.vdir, "disk-1")},
                             self.client.calls[1][1])
            self.assertEqual("disk-1", self.client.version)
        finally:
            self.assertEqual(0, side.stop())

    def test_vllm_refusing_is_the_trainers_error_and_the_model_is_unchanged(self):
        import wtx
        side = Sidecar(self.vllm.url)
        try:
            before = self.weights()
            self.client.fail = True
            with self.assertRaisesRegex(wtx.WtxError, "collective_rpc answered 500"):
                push(side.addr, tiny_llama(3), "refused")
            for n, p in self.model.named_parameters():
                self.assertTrue(torch.equal(before[n], p), n)
            self.assertEqual("resume", self.client.calls[-1][0])  # resumed even so
        finally:
            self.assertEqual(0, side.stop())

    def test_a_reload_refused_beside_a_plain_replica_is_undone_on_both(self):
        # Every replica or none: the plain replica publishes step-2, the
        # sidecar's vLLM refuses it; the trainer undoes step-2 on both,
        # and that vLLM loads step-1 again.
        import requests
        import wtx
        plain, side = Worker(), Sidecar(self.vllm.url)
        try:
            push([plain.addr, side.addr], tiny_llama(7), "step-1")
            before = self.weights()
            self.client.fail_times = 1
            with self.assertRaises(wtx.WtxError) as e:
                push([plain.addr, side.addr], tiny_llama(8), "step-2")
            msg = str(e.exception)
            self.assertIn(f"worker 1 ({side.addr})", msg)
            self.assertIn("published here, but the engine it feeds did not load it", msg)
            self.assertIn("so it was undone: every replica serves its weights from before "
                          "the update (version 'step-1')", msg)
            for n, p in self.model.named_parameters():
                self.assertTrue(torch.equal(before[n], p), n)
            self.assertEqual("step-1", requests.get(self.vllm.url + "/weight_info").json()
                             ["weight_version"])
            for addr in (plain.addr, side.addr):
                with wtx.WorkerClient(addr) as c:
                    self.assertEqual("step-1", c.get_weight_info()[0]["weight_version"], addr)
            with wtx.WorkerClient(side.addr) as c:
                self.assertEqual("step-1", c.get_weight_info()[0]["serving_version"])
            self.assertEqual([os.path.join(side.vdir, v) for v in ("step-1", "step-2", "step-1")],
                             [c[1]["weights_path"] for c in self.client.calls
                              if c[0] == "reload_weights"])
        finally:
            self.assertEqual(0, plain.stop())
            self.assertEqual(0, side.stop())

    def test_a_first_version_refused_cannot_be_taken_back_from_vllm_and_says_so(self):
        # The plain replica's first version is undone (it serves nothing
        # again); vLLM has no version before to load, so the trainer's error
        # lists the sidecar under "could not undo it", saying why.
        import wtx
        plain, side = Worker(), Sidecar(self.vllm.url)
        try:
            self.client.fail_times = 1
            with self.assertRaises(wtx.WtxError) as e:
                push([plain.addr, side.addr], tiny_llama(9), "first")
            msg = str(e.exception)
            self.assertIn(f"could not undo it: worker 1 ({side.addr})", msg)
            self.assertIn("there is no version before the first to load again", msg)
            with wtx.WorkerClient(plain.addr) as c:
                self.assertEqual("", c.get_weight_info()[0].get("weight_version", ""))
            self.assertEqual(1, [c[0] for c in self.client.calls].count("reload_weights"))
        finally:
            self.assertEqual(0, plain.stop())
            self.assertEqual(0, side.stop())

    def test_a_slow_vllm_is_a_timeout(self):
        import wtx
        side = Sidecar(self.vllm.url, timeout_ms=700)
        try:
            self.client.delay_s = 3.0
            t0 = time.time()
            with self.assertRaises(wtx.WtxError) as e:
                push(side.addr, tiny_llama(4), "slow")
            self.assertLess(time.time() - t0, 2.5)
            self.assertIn("no answer within 700 ms", str(e.exception))
            self.assertIn("DEADLINE_EXCEEDED", str(e.exception))
        finally:
            self.assertEqual(0, side.stop())

    def test_vllm_down_is_unavailable(self):
        import socket
        import wtx
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there now
        side = Sidecar(f"http://127.0.0.1:{port}")
        try:
            with self.assertRaises(wtx.WtxError) as e:
                push(side.addr, tiny_llama(5), "nobody")
            self.assertIn("UNAVAILABLE", str(e.exception))
            self.assertIn("vLLM /pause", str(e.exception))
        finally:
            self.assertEqual(0, side.stop())


if __name__ == "__main__":
    unittest.main(verbosity=2)
