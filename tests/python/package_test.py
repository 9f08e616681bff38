"""The Python package (python/) with real PyTorch (CPU) and transformers: a
trainer pushes a small Llama (random init from a config, no download) over
shm and tcp to two Python processes hosting models with different initial
weights (wtx.serve), and every parameter and the logits on a fixed prompt
end equal; a corrupted byte or an aborted update leaves the hosts' weights
unchanged; WorkerClient drives a standalone wtx-worker; the ctypes mirrors
match the C structs. Run by package.sh (WTX_LIBWTX, the generated stubs)."""
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import torch
import xxhash

PROMPT = torch.tensor([[1, 5, 9, 42, 7, 3, 200, 17]])


def tiny_llama(seed: int):
    """A 2-layer Llama of about 100k parameters, random weights from seed."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tp_weights():
    """The full weights of the tensor-parallel tests and the rules that
    split them over two hosts (col by rows, row by columns, norm whole)."""
    full = {"col.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4),
            "row.weight": torch.arange(32, dtype=torch.bfloat16).reshape(4, 8) / 7,
            "norm.weight": torch.full((4,), 3.0)}
    return full, "col.weight dim 0\nrow.weight dim 1\n"


class TpRank(torch.nn.Module):
    """A tensor-parallel host's module: its slices' shapes."""

    def __init__(self):
        super().__init__()
        self.col = torch.nn.Linear(4, 4, bias=False)
        self.row = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(4))


class TpLoaderRank(TpRank):
    """A TpRank with a loader, as vLLM's models have one: it copies each
    tensor it is handed into its parameter of that name."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)


@contextlib.contextmanager
def tp_hosts(rules, module=TpRank):
    """Two wtx.serve hosts of tensor-parallel ranks 0 and 1 of 2 under
    rules: (their modules, TpRank or module, the servers), the servers
    closed after."""
    import wtx
    ranks = [module(), module()]
    servers = [wtx.serve(m, "127.0.0.1:0", shard_rules=rules, tp_rank=r, tp_size=2)
               for r, m in enumerate(ranks)]
    try:
        yield ranks, servers
    finally:
        for s in servers:
            s.close()


def free_port() -> int:
    """A port free now, below the ephemeral range (no port-0 bind takes it)."""
    import random
    import socket
    while True:
        p = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                pass


def sync_two_ranks(test, addresses, source, version, token, transport="tcp"):
    """Two TrainerEngine ranks (threads) with many senders, rank r's source
    source(r), sync once to the workers at addresses; each rank's result."""
    import threading

    import wtx
    ranks = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    results, errors = [None, None], []

    def rank(r):
        try:
            c = wtx.WorkerClient(addresses)
            e = wtx.TrainerEngine.trainer_init(
                {"rank": r, "transport": transport, "world_size": 2, "rank_addresses": ranks,
                 "session_token": token}, client=c, source=source(r))
            results[r] = e.send_weights(version=version)
            e.shutdown()
            c.close()
        except BaseException as ex:  # noqa: BLE001 (reported below)
            errors.append(ex)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    test.assertEqual([], errors)
    return results


def expect_tp_slices(test, full, ranks) -> None:
    """Each TpRank host r holds exactly its slices of full."""
    for r, m in enumerate(ranks):
        test.assertTrue(torch.equal(m.col.weight.detach(), full["col.weight"].chunk(2, 0)[r]), r)
        test.assertTrue(torch.equal(m.row.weight.detach(), full["row.weight"].chunk(2, 1)[r]), r)
        test.assertTrue(torch.equal(m.norm.weight.detach(), full["norm.weight"]), r)


def expect_sent_once(test, full, results) -> None:
    """Many senders: every byte the two hosts hold was sent once, by the
    rank that owns it (the norm, whole on both hosts, counts twice), and
    rank 0 sent less than the model."""
    total = sum(t.numel() * t.element_size() for t in full.values())
    test.assertEqual(total + full["norm.weight"].numel() * 4,
                     results[0]["bytes"] + results[1]["bytes"])
    test.assertLess(results[0]["bytes"], total)


def dtensor_sync(test, *extra: str) -> None:
    """Two dtensor_rank.py processes (extra: its further arguments) sync to
    two tensor-parallel hosts; each host must end with exactly its slices,
    and the ranks' bytes must sum to what the hosts hold (with "delta": to
    the one part that changed, in a delta)."""
    import random

    full, rules = tp_weights()
    delta = "delta" in extra or "patches" in extra
    caller = "caller" in extra
    if delta or caller:
        full["col.weight"][4, 0] += 1
    if caller:
        full["col.weight"][0, 0] += 1
    addrs = ",".join(f"127.0.0.1:{random.randrange(20000, 32000)}" for _ in range(2))
    with tp_hosts(rules) as (ranks, servers):
        with tempfile.TemporaryDirectory() as d:
            procs = [subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(__file__), "dtensor_rank.py"),
                 str(r), os.path.join(d, "init"), ",".join(s.address for s in servers),
                 addrs, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(2)]
            outs = [p.communicate(timeout=120) for p in procs]
        errs = "\n".join(f"rank {r}: {err[-1500:]}" for r, (_, err) in enumerate(outs))
        for p in procs:
            test.assertEqual(0, p.returncode, errs)
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        if caller:
            # Rank 0 sends the caller's patches, each host the element in
            # its rows (an int32 index and a float32 value); rank 1 nothing.
            test.assertEqual("dt-2", results[0]["version"])
            test.assertEqual([16, 0], [r["bytes"] for r in results])
            test.assertEqual([True, False], [r["delta"] for r in results])
        elif delta:
            test.assertEqual("dt-2", results[0]["version"])
            test.assertEqual([True, True], [r["delta"] for r in results])
            test.assertEqual([1, 1], [r["params"] for r in results])
            # Only the host holding row 4 gets col's part again, from the
            # rank owning those rows: 0 bytes from rank 0. With patches,
            # that part (rank 1's whole shard) goes as a patch of its one
            # changed element: an int32 index and a float32 value.
            part = 8 if "patches" in extra else full["col.weight"][4:].nbytes
            test.assertEqual([0, part], [r["bytes"] for r in results])
            test.assertEqual([0, 1 if "patches" in extra else 0],
                             [r["patched_params"] for r in results])
        else:
            test.assertEqual("dt-1", results[0]["version"])
            expect_sent_once(test, full, results)
        expect_tp_slices(test, full, ranks)


class Host:
    """A wtx_host.py process: a tiny Llama of its own seed, served."""

    def __init__(self, seed: int, loader: bool = False, keep_base: bool = False) -> None:
        self.dir = tempfile.mkdtemp(prefix="wtx-host-")
        port_file = os.path.join(self.dir, "port")
        args = [sys.executable, os.path.join(os.path.dirname(__file__), "wtx_host.py"),
                "--seed", str(seed), "--port-file", port_file] + (["--loader"] if loader else []) \
            + (["--keep-base"] if keep_base else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        for _ in range(600):
            if os.path.exists(port_file):
                break
            if self.proc.poll() is not None:
                raise RuntimeError("wtx_host.py exited")
            time.sleep(0.05)
        with open(port_file) as f:
            self.addr = "127.0.0.1:" + f.read()

    def state(self) -> dict:
        path = os.path.join(self.dir, "state.pt")
        self.proc.stdin.write(f"state {path}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        return torch.load(path)

    def stop(self) -> int:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout=30)


class BufferHost(torch.nn.Module):
    """A host with a zeroed buffer like each of weights, loaded by name
    through load_weights (buffers cannot hold dots in their names: they
    are kept in inner with underscores)."""

    def __init__(self, weights: dict):
        super().__init__()
        self.inner = torch.nn.Module()
        for name, t in weights.items():
            self.inner.register_buffer(name.replace(".", "_"), torch.zeros_like(t))

    def load_weights(self, items):
        for name, t in items:
            getattr(self.inner, name.replace(".", "_")).copy_(t)


def same_weights(test, state: dict, model) -> None:
    params = dict(model.named_parameters())
    for name, p in params.items():
        test.assertTrue(torch.equal(state["params"][name], p.detach()), name)
    with torch.no_grad():
        test.assertTrue(torch.equal(state["logits"], model(PROMPT).logits))


class PushTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.hosts = [Host(1), Host(2, loader=True)]
        cls.initial = [h.state() for h in cls.hosts]

    @classmethod
    def tearDownClass(cls):
        for h in cls.hosts:
            assert h.stop() == 0

    def test_a_trainer_pushes_a_llama_over_shm_and_tcp_to_two_hosts(self):
        import wtx
        model = tiny_llama(0)
        # The hosts started with weights of their own.
        self.assertFalse(torch.equal(self.initial[0]["logits"], self.initial[1]["logits"]))
        client = wtx.WorkerClient([h.addr for h in self.hosts])
        for step, transport in enumerate(["shm", "tcp"]):
            with torch.no_grad():  # a training step changed the weights
                for p in model.parameters():
                    p.add_(0.01 * (step + 1))
            engine = wtx.TrainerEngine.trainer_init(
                wtx.WtxTrainerInitInfo(transport=transport, rank=0), client=client,
                source=wtx.TorchModuleSource(model))
            seen = []
            r = engine.send_weights(version=f"step-{step}", progress=lambda d, t: seen.append((d, t)))
            engine.shutdown()
            self.assertEqual(f"step-{step}", r["version"])
            self.assertEqual(sum(p.numel() * p.element_size() for p in model.parameters()),
                             r["bytes"])
            self.assertEqual(r["bytes"], seen[-1][0])
            for h in self.hosts:
                st = h.state()
                self.assertEqual(f"step-{step}", st["version"])
                same_weights(self, st, model)
        client.close()

    def test_a_corrupted_byte_or_an_aborted_update_leaves_the_hosts_unchanged(self):
        import wtx
        model = tiny_llama(3)
        client = wtx.WorkerClient([h.addr for h in self.hosts])
        engine = wtx.TrainerEngine.trainer_init({"rank": 0, "transport": "shm"}, client=client,
                                                source=wtx.TorchModuleSource(model))
        engine.send_weights(version="v1")
        engine.shutdown()
        name, p = next(iter(model.named_parameters()))
        data = (p.detach() + 1).contiguous().numpy().tobytes()
        region = f"/wtx-pkgtest-{os.getpid()}"
        with open("/dev/shm" + region, "wb") as f:
            f.write(data)
        try:
            update = {"params": [{"name": name, "dtype": "DTYPE_FLOAT32", "shape": list(p.shape)}],
                      "chunkBytes": str(len(data)), "shm": {"region": region}}
            client.init_weight_transfer_engine({"shm": {}, "checksum": "CHECKSUM_ALGORITHM_XXH3_64"})
            client.start_weight_update()
            bad = dict(update, xxh3_64=[str(xxhash.xxh3_64_intdigest(data) ^ 1)])
            with self.assertRaises(wtx.WtxError) as e:
                client.update_weights(bad)
            self.assertEqual("DATA_LOSS", e.exception.code.name)
            for h in self.hosts:
                same_weights(self, h.state(), model)
            client.start_weight_update(expected_params=1)  # says how many come
            good = dict(update, xxh3_64=[str(xxhash.xxh3_64_intdigest(data))])
            client.update_weights(good)  # staged, not loaded
            client.abort("test: abort after a good chunk")
            for h in self.hosts:
                st = h.state()
                self.assertEqual("v1", st["version"])
                same_weights(self, st, model)
        finally:
            os.unlink("/dev/shm" + region)
        client.close()

    def test_a_delta_reaches_served_modules_with_only_what_changed(self):
        import wtx
        model = tiny_llama(5)
        client = wtx.WorkerClient([h.addr for h in self.hosts])
        engine = wtx.TrainerEngine.trainer_init(
            wtx.WtxTrainerInitInfo(transport="shm", rank=0, delta=True), client=client,
            source=wtx.TorchModuleSource(model))
        engine.send_weights(version="d1")
        name, p = next(iter(model.named_parameters()))
        with torch.no_grad():
            p[0].add_(1.0)  # one row of one tensor, in place
        r = engine.send_weights(version="d2")
        self.assertTrue(r["delta"], r["full_reason"])
        self.assertEqual(1, r["params"])
        self.assertEqual(p.numel() * p.element_size(), r["bytes"])
        n = len(list(model.parameters()))
        self.assertEqual(n - 1, r["skipped_params"])
        self.assertEqual(n, len(r["xxh3"]))
        for h in self.hosts:
            st = h.state()
            self.assertEqual("d2", st["version"])
            same_weights(self, st, model)  # the rest carried over, logits included
        engine.shutdown()
        client.close()

    def test_patches_reach_a_served_module_whole_where_its_names_are_its_own(self):
        import wtx
        model = tiny_llama(6)
        own = wtx.WorkerClient([self.hosts[0].addr])  # no load_weights: reads its tensors back
        engine = wtx.TrainerEngine.trainer_init(
            wtx.WtxTrainerInitInfo(transport="shm", rank=0, delta="patches"), client=own,
            source=wtx.TorchModuleSource(model))
        engine.send_weights(version="q1")
        name, p = next(iter(model.named_parameters()))
        with torch.no_grad():
            p.view(-1)[3] = float("nan")  # one element, a NaN
        r = engine.send_weights(version="q2")
        self.assertEqual(1, r["patched_params"], r)
        self.assertEqual(4 + p.element_size(), r["bytes"])
        st = self.hosts[0].state()
        self.assertEqual("q2", st["version"])
        bits = lambda t: t.detach().contiguous().view(torch.uint8)  # NaN compared as bits
        self.assertTrue(torch.equal(bits(st["params"][name]), bits(p)))
        for other, q in list(model.named_parameters())[1:]:
            self.assertTrue(torch.equal(bits(st["params"][other]), bits(q)), other)
        engine.shutdown()
        own.close()
        # A host whose load_weights maps names takes whole tensors: the same
        # engine settings then send the changed tensor whole.
        both = wtx.WorkerClient([h.addr for h in self.hosts])
        engine = wtx.TrainerEngine.trainer_init(
            wtx.WtxTrainerInitInfo(transport="shm", rank=0, delta="patches"), client=both,
            source=wtx.TorchModuleSource(model))
        engine.send_weights(version="q3")
        with torch.no_grad():
            p.view(-1)[5] = 2.0
        r = engine.send_weights(version="q4")
        self.assertTrue(r["delta"])
        self.assertEqual(0, r["patched_params"])
        self.assertEqual(p.numel() * p.element_size(), r["bytes"])
        for h in self.hosts:
            st = h.state()
            self.assertEqual("q4", st["version"])
            self.assertTrue(torch.equal(bits(st["params"][name]), bits(p)))
        engine.shutdown()
        both.close()

    def test_a_host_that_keeps_its_base_takes_patches_through_load_weights(self):
        import wtx
        model = tiny_llama(7)
        host = Host(3, loader=True, keep_base=True)
        try:
            client = wtx.WorkerClient([host.addr])
            engine = wtx.TrainerEngine.trainer_init(
                wtx.WtxTrainerInitInfo(transport="tcp", rank=0, delta="patches"),
                client=client, source=wtx.TorchModuleSource(model))
            engine.send_weights(version="b1")
            params = list(model.named_parameters())
            (name, p), (other, q) = params[0], params[-1]
            bits = lambda t: t.detach().contiguous().view(torch.uint8)  # NaN compared as bits
            with torch.no_grad():
                p.view(-1)[3] = float("nan")
            r = engine.send_weights(version="b2")
            self.assertEqual(1, r["patched_params"], r)
            self.assertEqual(4 + p.element_size(), r["bytes"])
            st = host.state()
            self.assertEqual("b2", st["version"])
            # load_weights got the patched tensor whole, and only it.
            self.assertEqual([name], st["loaded"][len(params):])
            self.assertTrue(torch.equal(bits(st["params"][name]), bits(p)))
            # A second patch applies to the first's result (the base kept
            # at the last commit), here of another tensor too.
            with torch.no_grad():
                p.view(-1)[4] = 5.0
                q.view(-1)[0] = -1.0
            r = engine.send_weights(version="b3")
            self.assertEqual(2, r["patched_params"], r)
            st = host.state()
            self.assertEqual("b3", st["version"])
            for n, t in params:
                self.assertTrue(torch.equal(bits(st["params"][n]), bits(t)), n)
            engine.shutdown()
            client.close()
        finally:
            self.assertEqual(0, host.stop())
        with self.assertRaisesRegex(ValueError, "keep_base"):
            wtx.serve(model, keep_base=True, narrow_loads=True)

    def test_pause_and_resume_reach_the_hosts_callbacks(self):
        import wtx
        with wtx.WorkerClient(self.hosts[0].addr) as c:
            c.pause(wait_for_inflight=False)
            c.resume()
        self.assertEqual([False, "resume"], self.hosts[0].state()["pauses"][-2:])


class Worker:
    """A wtx-worker process on loopback (extra: more flags)."""

    def __init__(self, *extra):
        self.dir = tempfile.mkdtemp(prefix="wtx-w-")
        pf = os.path.join(self.dir, "port")
        self.proc = subprocess.Popen([os.environ["WTX_WORKER"], "--listen", "127.0.0.1:0",
                                      "--port-file", pf, "--log-level", "warn", *extra])
        for _ in range(500):
            if os.path.exists(pf) and os.path.getsize(pf):
                break
            time.sleep(0.02)
        with open(pf) as f:
            self.addr = "127.0.0.1:" + f.read().strip()

    def stop(self):
        self.proc.terminate()
        return self.proc.wait(timeout=20)


class StandaloneWorkerTest(unittest.TestCase):
    def setUp(self):
        self.w = Worker()

    def tearDown(self):
        self.assertEqual(0, self.w.stop())

    def test_worker_client_drives_the_four_calls_and_the_control_calls(self):
        import wtx
        data = torch.arange(16, dtype=torch.float32).numpy().tobytes()
        region = f"/wtx-pkgw-{os.getpid()}"
        with open("/dev/shm" + region, "wb") as f:
            f.write(data)
        try:
            c = wtx.WorkerClient([self.w.addr], timeout=20)
            c.init_weight_transfer_engine({"shm": {}})
            c.start_weight_update()
            c.update_weights([{"params": [{"name": "w", "dtype": "DTYPE_FLOAT32", "shape": [4, 4]}],
                               "shm": {"region": region},
                               "xxh3_64": [str(xxhash.xxh3_64_intdigest(data))]}])
            c.finish_weight_update("first")
        finally:
            os.unlink("/dev/shm" + region)
        info = c.get_weight_info(include_params=True)[0]
        self.assertEqual("first", info["weight_version"])
        self.assertEqual("w", info["params"][0]["meta"]["name"])
        self.assertEqual(1, c.get_world_size())
        self.assertEqual(["first"], c.update_weight_version("renamed"))
        c.pause()
        self.assertTrue(c.get_weight_info()[0].get("paused"))
        c.resume()
        c.close()

    def test_the_callers_patches_reach_a_worker_in_vllms_sparse_shape(self):
        import dataclasses
        import wtx

        @dataclasses.dataclass
        class SparseWeightPatch:  # vLLM's sparse_nccl shape
            name: str
            indices: torch.Tensor
            values: torch.Tensor
            full_shape: tuple

        w = torch.linspace(-1, 1, 64).to(torch.bfloat16).reshape(8, 8)
        b = torch.arange(10, dtype=torch.int8)
        c = wtx.WorkerClient([self.w.addr])
        e = wtx.TrainerEngine.trainer_init({"rank": 0, "transport": "tcp"}, client=c,
                                           source=wtx.DictSource({"w": w, "b": b}))
        e.send_weights(version="base")
        e.shutdown()
        sparse = wtx.TrainerEngine.trainer_init({"rank": 0, "transport": "tcp"}, client=c)
        idx = torch.tensor([63, 0, 17])  # any order, int64
        vals = torch.tensor([float("nan"), 5.0, -3.0], dtype=torch.bfloat16)
        r = sparse.send_weights([SparseWeightPatch("w", idx, vals, (8, 8))], version="p")
        self.assertEqual(1, r["params"])
        self.assertEqual(3 * (4 + 2), r["bytes"])
        want = w.clone().reshape(-1)
        want[idx] = vals
        info = {p["meta"]["name"]: p for p in c.get_weight_info(include_params=True)[0]["params"]}
        raw = want.view(torch.uint8).numpy().tobytes()
        self.assertEqual(str(xxhash.xxh3_64_intdigest(raw)), info["w"]["xxh3_64"])
        self.assertEqual(str(xxhash.xxh3_64_intdigest(b.numpy().tobytes())), info["b"]["xxh3_64"])
        with self.assertRaises(ValueError) as err:  # an index twice: bad arguments
            sparse.send_weights([{"name": "b", "indices": [3, 3], "values": torch.tensor(
                [1, 2], dtype=torch.int8), "full_shape": [10]}], version="never")
        self.assertIn("'b'", str(err.exception))
        self.assertIn("none repeats", str(err.exception))
        self.assertEqual("p", c.get_weight_info()[0]["weight_version"])
        sparse.shutdown()
        c.close()

    def test_dtypes_layouts_and_numpy_arrive_bit_exact(self):
        import numpy as np
        import wtx
        tensors = {
            "np.f32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
            "bf16": torch.linspace(-2, 2, 10).to(torch.bfloat16),
            "fp8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
            "transposed": torch.arange(12.).reshape(3, 4).t(),  # not contiguous: copied once
            "i64": torch.tensor([1, -2, 3], dtype=torch.int64),
            "bool": torch.tensor([True, False]),
            "empty": torch.zeros(0, 5),
        }
        c = wtx.WorkerClient([self.w.addr])
        e = wtx.TrainerEngine.trainer_init({"rank": 0, "transport": "tcp", "checksum": "xxh3_64"},
                                           client=c, source=wtx.DictSource(tensors))
        r = e.send_weights(version="dt")
        e.shutdown()
        info = c.get_weight_info(include_params=True)[0]
        got = {p["meta"]["name"]: p for p in info["params"]}
        for i, (name, t) in enumerate(tensors.items()):
            raw = (t.contiguous().view(torch.uint8).numpy().tobytes()
                   if isinstance(t, torch.Tensor) else np.ascontiguousarray(t).tobytes())
            self.assertEqual(xxhash.xxh3_64_intdigest(raw), r["xxh3"][i], name)
            self.assertEqual(str(r["xxh3"][i]), got[name]["xxh3_64"], name)
        self.assertEqual("DTYPE_FLOAT8_E4M3FN", got["fp8"]["meta"]["dtype"])
        self.assertEqual(["4", "3"], got["transposed"]["meta"]["shape"])
        c.close()

    def test_a_source_disagreeing_with_its_metadata_names_the_tensor_and_keeps_the_weights(self):
        import wtx

        class Lying:
            @property
            def metadata(self):
                return [wtx.ParamMeta("a", torch.float32, (4,)), wtx.ParamMeta("b", torch.float32, (2,))]

            def iter_full(self):
                yield "a", torch.ones(4)
                yield "b", torch.ones(3)  # not what metadata says

        c = wtx.WorkerClient([self.w.addr])
        e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c, source=Lying())
        with self.assertRaises(ValueError) as ex:  # the source's fault, found before the wire
            e.send_weights()
        self.assertIn("'b'", str(ex.exception))
        e.shutdown()
        self.assertEqual("", c.get_weight_info()[0].get("weight_version", ""))
        c.close()


    def test_a_tensor_unlike_its_metadata_in_any_one_way_is_caught_by_name(self):
        # The adapter describes a tensor from its metadata without building a
        # meta only when name, dtype, shape and bytes all agree; each liar
        # below differs in one of them and must still be caught.
        import wtx

        def liar(yields):
            class Liar:
                metadata = [wtx.ParamMeta("a", torch.float32, (4,)),
                            wtx.ParamMeta("b", torch.float32, (2, 2))]

                def iter_full(self):
                    yield from yields
            return Liar()

        cases = {  # what differs: (what the source yields, the name it is caught by)
            "dtype, same bytes": ([("a", torch.ones(4)), ("b", torch.ones(8, dtype=torch.float16))],
                                  "b"),
            "shape, same bytes": ([("a", torch.ones(4)), ("b", torch.ones(4))], "b"),
            "order": ([("b", torch.ones(2, 2)), ("a", torch.ones(4))], "b"),
            "name": ([("a", torch.ones(4)), ("c", torch.ones(2, 2))], "c"),
        }
        c = wtx.WorkerClient([self.w.addr])
        for what, (yields, bad) in cases.items():
            with self.subTest(what):
                e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c, source=liar(yields))
                with self.assertRaises(ValueError) as ex:
                    e.send_weights()
                self.assertIn(f"'{bad}'", str(ex.exception))
                e.shutdown()
        self.assertEqual("", c.get_weight_info()[0].get("weight_version", ""))
        c.close()

    def test_a_module_parameter_changed_since_metadata_is_caught_by_name(self):
        # The adapter's fast case (a module's own parameter on the host,
        # exactly as metadata describes it) must still catch a parameter
        # whose shape or dtype changed after metadata was taken, and keep
        # the weights published before.
        import wtx
        changes = {"shape": lambda p: torch.ones(3), "dtype": lambda p: p.data.double()}
        c = wtx.WorkerClient([self.w.addr])
        for what, change in changes.items():
            with self.subTest(what):
                m = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4)) for _ in range(3)])
                e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c,
                                                   source=wtx.TorchModuleSource(m))
                first = e.send_weights()["version"]
                m[1].data = change(m[1])
                with self.assertRaises(ValueError) as ex:
                    e.send_weights()
                self.assertIn("'1'", str(ex.exception))
                e.shutdown()
                self.assertEqual(first, c.get_weight_info()[0]["weight_version"])
        c.close()

    def test_an_unchanged_module_is_sent_without_a_pass_and_every_change_is_seen(self):
        # After a pass whose every tensor went in place, a sync whose module
        # registered nothing and whose parameters' storage stayed put is
        # sent from the adapter's table, with no pass over the module; the
        # bytes are read where they are, so an optimizer's in-place step
        # arrives. A replaced parameter, or its storage moved, makes a pass.
        import wtx
        n = 1300  # more than one batch
        m = torch.nn.ParameterList([torch.nn.Parameter(torch.full((3,), float(i)))
                                    for i in range(n)])

        class Counting(wtx.TorchModuleSource):
            passes = 0

            def iter_full(self):
                Counting.passes += 1
                yield from super().iter_full()

        def sums():
            return [xxhash.xxh3_64_intdigest(p.detach().numpy().tobytes()) for p in m]

        c = wtx.WorkerClient([self.w.addr])
        e = wtx.TrainerEngine.trainer_init({"rank": 0, "checksum": "xxh3_64"}, client=c,
                                           source=Counting(m))
        steps = [("first", None, 1),
                 ("an in-place step", lambda: [p.add_(1) for p in m], 1),
                 ("a parameter replaced", lambda: m.__setitem__(5, torch.nn.Parameter(
                     torch.full((3,), -5.0))), 2),
                 ("a storage moved", lambda: setattr(m[7], "data", torch.full((3,), 99.0)), 3),
                 ("nothing", lambda: None, 3)]
        results = []
        for what, change, passes in steps:
            with self.subTest(what):
                if change is not None:
                    with torch.no_grad():
                        change()
                r = e.send_weights(version=what)
                self.assertEqual(passes, Counting.passes)
                self.assertEqual(sums(), list(r["xxh3"]))
                info = c.get_weight_info(include_params=True)[0]
                self.assertEqual(what, info["weight_version"])
                self.assertEqual(sums(), [int(p["xxh3_64"]) for p in info["params"]])
                results.append((r["xxh3"], sums()))
        # Each result keeps its own sums (a sequence over a copy, not over
        # the engine's array, which the next sync rewrites), and reads as
        # the list does.
        first, later = results[0], results[1]
        self.assertNotEqual(first[1], later[1])
        self.assertEqual(first[1], first[0])
        self.assertEqual(first[0], first[1])
        self.assertEqual(len(first[1]), len(first[0]))
        self.assertEqual(first[1][2:5], first[0][2:5])
        self.assertEqual(first[1][-1], first[0][-1])
        self.assertNotEqual(later[0], first[0])
        e.shutdown()
        c.close()

    def test_a_module_source_sends_a_gathered_parameter_whole(self):
        # A parameter whose type has full_tensor (as a DTensor's has) is sent
        # as full_tensor() gives it, the others from their own memory.
        import wtx

        class Gathered(torch.nn.Parameter):  # full_tensor: the "gathered" bytes
            def full_tensor(self):
                return self.detach() * 2

        m = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4)),
                                    Gathered(torch.full((4,), 3.0))])
        c = wtx.WorkerClient([self.w.addr])
        e = wtx.TrainerEngine.trainer_init({"rank": 0, "checksum": "xxh3_64"}, client=c,
                                           source=wtx.TorchModuleSource(m))
        r = e.send_weights()
        e.shutdown()
        c.close()
        sums = [xxhash.xxh3_64_intdigest(t.numpy().tobytes())
                for t in (torch.ones(4), torch.full((4,), 6.0))]
        self.assertEqual(sums, list(r["xxh3"][:2]))

    def test_a_pass_of_many_tensors_arrives_whole_and_holds_one_copy_at_a_time(self):
        # The adapter hands the engine batches of tensors (one callback per
        # batch): a pass longer than a batch arrives whole and in order,
        # mixing tensors sent from their own memory with copies made for the
        # pass, and a batch ends at a copy, so no more than one is alive.
        import weakref
        import wtx
        n = 1300
        alive: list = []
        most = [0]

        class Gathering:  # every third tensor made for the pass, as a gathered DTensor is
            holds_tensors = False
            params = [torch.nn.Parameter(torch.full((3,), float(i))) for i in range(n)]
            metadata = [wtx.ParamMeta(f"p.{i}", torch.float32, (3,)) for i in range(n)]

            def iter_full(self):
                for i, p in enumerate(self.params):
                    if i % 3:
                        yield f"p.{i}", p
                        continue
                    t = torch.full((3,), float(i))
                    alive.append(weakref.ref(t))
                    most[0] = max(most[0], sum(r() is not None for r in alive))
                    yield f"p.{i}", t

        c = wtx.WorkerClient([self.w.addr])
        e = wtx.TrainerEngine.trainer_init({"rank": 0, "checksum": "xxh3_64"}, client=c,
                                           source=Gathering())
        r = e.send_weights(version="many")
        e.shutdown()
        self.assertEqual(n, r["params"])
        for i in range(n):
            raw = torch.full((3,), float(i)).numpy().tobytes()
            self.assertEqual(xxhash.xxh3_64_intdigest(raw), r["xxh3"][i], i)
        self.assertEqual(1, most[0])  # the copy before is gone when the next is made
        info = c.get_weight_info(include_params=True)[0]
        self.assertEqual([f"p.{i}" for i in range(n)], [p["meta"]["name"] for p in info["params"]])
        c.close()

class ContractTest(unittest.TestCase):
    def test_dicts_are_parsed_strictly_before_any_call(self):
        import wtx
        c = wtx.WorkerClient(["127.0.0.1:1"])  # never reached: parsing fails first
        with self.assertRaisesRegex(ValueError, "no field named \"bogus\""):
            c.init_weight_transfer_engine({"shm": {}, "bogus": 1})
        with self.assertRaisesRegex(ValueError, "timeoutMs"):
            c.init_weight_transfer_engine({"timeoutMs": "soon"})
        with self.assertRaisesRegex(ValueError, "update_info"):
            c.update_weights({"params": "not a list"})
        with self.assertRaisesRegex(ValueError, "unknown field 'bogus'"):
            wtx.WtxTrainerInitInfo.from_any({"rank": 0, "bogus": 1})
        with self.assertRaisesRegex(ValueError, "transport"):
            wtx.WtxTrainerInitInfo(transport="carrier-pigeon", rank=0)
        self.assertEqual("wtx", wtx.WtxTrainerInitInfo.backend)

    def test_a_parameter_rank_zero_does_not_own_is_refused_by_name(self):
        import wtx

        class Sharded:
            metadata = [wtx.ParamMeta("mine", torch.float32, (2,)),
                        wtx.ParamMeta("theirs", torch.float32, (2,), owners=(1, 2))]

            def iter_full(self):
                yield "mine", torch.ones(2)

        with self.assertRaisesRegex(ValueError, "'theirs' is not owned by the sending rank 0"):
            wtx.TrainerEngine.trainer_init({"rank": 0}, client=None, source=Sharded())

    def test_ranks_other_than_zero_iterate_and_send_nothing(self):
        import wtx
        passes = []

        class Counting(wtx.DictSource):
            def iter_full(self):
                passes.append(1)
                yield from super().iter_full()

        e = wtx.TrainerEngine.trainer_init({"rank": 1}, client=None,
                                           source=Counting({"a": torch.ones(3)}))
        e.send_weights()
        e.send_weights()
        e.shutdown()
        self.assertEqual(2, len(passes))

    def test_the_ctypes_mirrors_match_the_c_structs(self):
        from wtx import _capi
        probe = json.loads(subprocess.check_output([os.environ["WTX_ABI_PROBE"]]))
        self.assertEqual(set(probe), set(_capi.STRUCTS))
        for name, cls in _capi.STRUCTS.items():
            self.assertEqual(probe[name]["size"], ctypes.sizeof(cls), name)
            for field, off in probe[name]["fields"].items():
                self.assertEqual(off, getattr(cls, field).offset, f"{name}.{field}")

    def test_serve_stages_a_cpu_model_on_the_host_and_checks_its_gpu(self):
        # A model on the CPU gets host staging whatever the backend (no
        # stage_device for the C worker); the GPU the GPU backends would
        # receive on must be an ordinal, refused at start otherwise.
        import wtx
        model = torch.nn.Linear(2, 2)
        with self.assertRaisesRegex(wtx.WtxError, "cuda_device: not a device ordinal"):
            wtx.serve(model, "127.0.0.1:0", cuda_device=-1)
        with wtx.serve(model, "127.0.0.1:0", cuda_device=3) as server:
            self.assertFalse(server._host.ops.stage_device)
            self.assertTrue(server._host.ops.stage)

    def test_a_served_module_lists_its_parameters_once_per_update(self):
        # A module without load_weights is checked tensor by tensor against
        # its own parameters; listing them for every tensor made an update
        # quadratic in the parameter count. They are listed once per
        # update, and again for the next one, which sees the module as it
        # then is.
        import wtx

        class Counted(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.p = torch.nn.ParameterList(
                    [torch.nn.Parameter(torch.zeros(3)) for _ in range(200)])
                self.listed = 0

            def named_parameters(self, *a, **k):
                self.listed += 1
                return super().named_parameters(*a, **k)

        model = Counted()
        with wtx.serve(model, "127.0.0.1:0") as server:
            c = wtx.WorkerClient([server.address])
            for step in (1, 2):
                weights = {f"p.{i}": torch.full((3,), float(step * i)) for i in range(200)}
                e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c,
                                                   source=wtx.DictSource(weights))
                before = model.listed
                e.send_weights()
                e.shutdown()
                self.assertLessEqual(model.listed - before, 2, f"update {step}")
                self.assertTrue(torch.equal(model.p[199].detach(), weights["p.199"]))
            # A name the module lacks is still refused by name, before any
            # byte moves.
            e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c, source=wtx.DictSource(
                {"p.0": torch.zeros(3), "nope": torch.zeros(3)}))
            with self.assertRaisesRegex(wtx.WtxError, "'nope' is not in the module"):
                e.send_weights()
            e.shutdown()
            c.close()

    def test_tensor_parallel_hosts_receive_only_their_slices(self):
        # Two hosts of tensor-parallel ranks 0 and 1 of 2 hold modules with
        # their slices' shapes (as a TP inference rank's parameters are);
        # the trainer's engine sends each exactly its slices, from the full
        # weights, in one sync.
        import wtx

        full, rules = tp_weights()
        with tp_hosts(rules) as (ranks, servers):
            c = wtx.WorkerClient([s.address for s in servers])
            e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c,
                                               source=wtx.DictSource(full))
            r = e.send_weights(version="tp-1")
            e.shutdown()
            c.close()
            self.assertEqual("tp-1", r["version"])
            self.assertEqual(sum(t.numel() * t.element_size() for t in full.values())
                             + full["norm.weight"].numel() * 4, r["bytes"])  # norm: both
            expect_tp_slices(self, full, ranks)

    def test_deltas_and_patches_to_tensor_parallel_hosts_reach_only_their_slices(self):
        # One element of col.weight's last row changes: only host 1 holds
        # it, so only its half of col.weight travels (whole, then as a patch
        # of its slice), and host 0 keeps its slices. Then the caller's own
        # patches, cut to each host's slices.
        import wtx

        full, rules = tp_weights()
        with tp_hosts(rules) as (ranks, servers):
            c = wtx.WorkerClient([s.address for s in servers])
            for step, mode in enumerate((True, "patches")):
                e = wtx.TrainerEngine.trainer_init({"rank": 0, "delta": mode}, client=c,
                                                   source=wtx.DictSource(full))
                e.send_weights(version=f"d{step}-0")
                full["col.weight"][7, 1] += 1.0
                r = e.send_weights(version=f"d{step}-1")
                e.shutdown()
                self.assertTrue(r["delta"], r["full_reason"])
                self.assertEqual(1, r["params"])
                self.assertEqual(5, r["skipped_params"])  # 3 tensors, 2 hosts
                if mode is True:
                    self.assertEqual(4 * 4 * 4, r["bytes"])  # host 1's 4 rows of col.weight
                else:
                    self.assertEqual(1, r["patched_params"])
                    self.assertEqual(4 + 4, r["bytes"])  # one int32 index, one float32
                expect_tp_slices(self, full, ranks)
            # The caller's patches (vLLM's sparse_nccl shape, indices into the
            # whole tensor): each host gets the elements in its slices.
            e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c, source=wtx.DictSource(full))
            idx = torch.tensor([1, 30])  # col.weight's rows 0 and 7: host 0, host 1
            val = torch.tensor([-1.0, float("nan")])
            r = e.send_weights([{"name": "col.weight", "indices": idx, "values": val,
                                 "full_shape": (8, 4)}], version="p-1")
            e.shutdown()
            c.close()
            self.assertEqual(2, r["patched_params"])
            full["col.weight"].view(-1)[idx] = val
            for rank, m in enumerate(ranks):
                got, want = m.col.weight.detach(), full["col.weight"].chunk(2, 0)[rank]
                self.assertTrue(torch.equal(got.view(torch.int32), want.view(torch.int32)), rank)

    def test_two_trainer_ranks_each_send_their_own_parts_to_tensor_parallel_hosts(self):
        # Many senders: two TrainerEngine ranks, each holding only its half
        # of dim 0 of every tensor (vLLM's ParamMeta ownership, iter_local),
        # sync to two hosts of tensor-parallel ranks 0 and 1 of 2. Each rank
        # sends only its own bytes; each host ends with exactly its slices.
        self.two_ranks_to_tensor_parallel_hosts(0)

    def test_row_parallel_trainer_ranks_feed_tensor_parallel_hosts_in_boxes(self):
        # The same ranks splitting dim 1 (a row-parallel trainer's layout):
        # their halves of col.weight are columns, which no host keeps as one
        # run (each keeps rows), so they travel as boxes that the Python
        # hosts' staging takes scattered; row.weight's halves are runs.
        self.two_ranks_to_tensor_parallel_hosts(1)

    def test_ranks_on_the_hosts_machine_write_straight_where_a_loader_reads(self):
        # Over shm, to hosts whose module has a loader (as vLLM's do): each
        # worker makes one receive region in shared memory, each rank
        # writes its bytes there (the only copy before the loader's own),
        # and the host hands the loader views of them where they lie,
        # staging nothing. A row-parallel trainer's boxes cannot lie where
        # the stream puts them: those alone are staged (each host's slice
        # of col.weight, 4 rows of 4 float32).
        for dim, staged in ((0, 0), (1, 4 * 4 * 4)):
            peaks = self.two_ranks_to_tensor_parallel_hosts(dim, "shm", TpLoaderRank)
            self.assertEqual([staged, staged], peaks, f"dim {dim}")

    def test_a_loader_reading_in_place_gets_every_kind_of_tensor_bit_exact(self):
        # Tensors of every width, one of no bytes among them, from two
        # ranks each owning every other tensor whole. Over tcp they are
        # staged; over shm, packed without padding in the worker's receive
        # region, those at a multiple of their element size are handed to
        # the loader where they lie (f, large, first: a view of its own; e,
        # a byte), the others copied out first (b at byte 80003, ...). The
        # tensors of no bytes have no piece on any rank: each rides in the
        # chunk where it falls, its sender hashing its empty span: between
        # two senders' tensors (x), one sender's (z), and last (y).
        for transport in ("tcp", "shm"):
            with self.subTest(transport=transport):
                self.loader_gets_every_kind(transport)

    def loader_gets_every_kind(self, transport):
        import wtx
        from wtx.sources import ParamMeta

        g = torch.Generator().manual_seed(3)
        full = {"f": torch.randn(20000, generator=g),  # 80000 bytes: over _SMALL
                "x": torch.zeros(0, 4),
                "a": torch.randint(-100, 100, (3,), dtype=torch.int8, generator=g),
                "b": torch.randn(5, 3, generator=g),
                "c": torch.randn(7, generator=g).to(torch.bfloat16),
                "d": torch.randn(2, generator=g).to(torch.float64),
                "e": torch.tensor([True]),
                "z": torch.zeros(0, dtype=torch.uint8),
                "h": torch.randint(0, 1 << 30, (9,), dtype=torch.int64, generator=g),
                "y": torch.zeros(0, dtype=torch.float16)}
        names = list(full)
        owner = {n: int(n in "acehx") for n in names}

        class Loader(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.got = {}

            def load_weights(self, weights):
                for name, t in weights:
                    self.got[name] = t.clone()

        class RankSource:
            def __init__(self, rank):
                self.rank = rank

            @property
            def metadata(self):
                return [ParamMeta(n, full[n].dtype, tuple(full[n].shape), owners=(owner[n],))
                        for n in names]

            def iter_local(self):
                for n in names:
                    if owner[n] == self.rank:
                        yield n, full[n]

        module = Loader()
        server = wtx.serve(module, "127.0.0.1:0")
        try:
            sync_two_ranks(self, [server.address], RankSource, "k-1",
                           "python-in-place-kinds-token", transport)
            self.assertEqual("k-1", server.version)
            for n, t in full.items():
                got = module.got[n]
                self.assertEqual((t.dtype, t.shape), (got.dtype, got.shape), n)
                self.assertEqual(t.view(torch.uint8).flatten().tolist() if t.numel() else [],
                                 got.view(torch.uint8).flatten().tolist() if got.numel() else [],
                                 n)
            # Over shm only the tensors off their element size's boundary
            # were copied (staged): f, the large one, was read where it lay.
            peak = server.staged_peak_bytes
            total = sum(t.nbytes for t in full.values())
            if transport == "shm":
                self.assertGreater(peak, 0)
                self.assertLess(peak, total - full["f"].nbytes)
            else:
                self.assertGreaterEqual(peak, total)
        finally:
            server.close()

    def two_ranks_to_tensor_parallel_hosts(self, dim, transport="tcp", module=TpRank):
        """Each host's staged_peak_bytes after the sync."""
        from wtx.sources import ParamMeta

        full, rules = tp_weights()

        class Shard:
            def __init__(self, t):
                self.dim = dim if t.dim() > dim else 0

        class RankSource:
            def __init__(self, rank):
                self.rank = rank

            @property
            def metadata(self):
                return [ParamMeta(n, t.dtype, tuple(t.shape), owners=(0, 1),
                                  placements=(Shard(t),)) for n, t in full.items()]

            def iter_local(self):
                for n, t in full.items():
                    yield n, t.chunk(2, Shard(t).dim)[self.rank].contiguous()

            def iter_full(self):
                raise AssertionError("many senders never gather")

        with tp_hosts(rules, module) as (ranks, servers):
            results = sync_two_ranks(self, [s.address for s in servers], RankSource, "m-1",
                                     "python-many-senders-token", transport)
            self.assertEqual("m-1", results[0]["version"])
            expect_sent_once(self, full, results)
            expect_tp_slices(self, full, ranks)
            return [s.staged_peak_bytes for s in servers]

    def test_dtensor_ranks_send_their_local_parts_without_a_gather(self):
        # Two processes whose module's weights are DTensors, Shard(0) over a
        # 2-rank CPU mesh (gloo): TorchModuleSource declares their owners,
        # mesh and placements, and each rank sends its to_local() part to
        # the tensor-parallel hosts, which end with exactly their slices.
        dtensor_sync(self)

    def test_dtensor_ranks_send_a_delta_of_the_one_part_that_changed(self):
        # Many senders with delta=True: the ranks hash their own shards, rank
        # 0 asks them which changed, and only the part of col.weight that
        # holds the changed row travels, to the one host holding it.
        dtensor_sync(self, "delta")

    def test_dtensor_ranks_send_a_whole_host_a_patch_of_each_changed_shard(self):
        # delta="patches" to a host that keeps whole tensors: its col.weight
        # is fed by both ranks' shards, and an element changed in each, so
        # it travels as a patch of two spans, one from each rank (an int32
        # index and a float32 value each), applied to the host's copy.
        import random

        import wtx
        full, _ = tp_weights()
        full["col.weight"][0, 0] += 1
        full["col.weight"][4, 0] += 1
        host = TpRank()
        host.col = torch.nn.Linear(4, 8, bias=False)
        host.row = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
        server = wtx.serve(host, "127.0.0.1:0")
        addrs = ",".join(f"127.0.0.1:{random.randrange(20000, 32000)}" for _ in range(2))
        try:
            with tempfile.TemporaryDirectory() as d:
                procs = [subprocess.Popen(
                    [sys.executable, os.path.join(os.path.dirname(__file__), "dtensor_rank.py"),
                     str(r), os.path.join(d, "init"), server.address, addrs, "patches-both"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for r in range(2)]
                outs = [p.communicate(timeout=120) for p in procs]
        finally:
            server.close()
        errs = "\n".join(f"rank {r}: {err[-1500:]}" for r, (_, err) in enumerate(outs))
        for p in procs:
            self.assertEqual(0, p.returncode, errs)
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        self.assertEqual([True, True], [r["delta"] for r in results])
        self.assertEqual([8, 8], [r["bytes"] for r in results])
        self.assertEqual([1, 1], [r["patched_params"] for r in results])
        for name, want in full.items():
            self.assertTrue(torch.equal(host.get_parameter(name).detach(), want), name)

    def test_dtensor_ranks_send_the_callers_patches_from_rank_0(self):
        # send_weights(patches) on every rank of a DTensor trainer, as
        # vLLM's sparse_nccl trainer calls it: rank 0 sends them all, each
        # tensor-parallel host the elements in its slice, and rank 1's call
        # sends nothing.
        dtensor_sync(self, "caller")

    def test_dtensor_ranks_send_a_patch_of_the_one_element_that_changed(self):
        # delta="patches": the host's part of col.weight is rank 1's shard
        # alone, so rank 1 sends a patch of its one changed element, which
        # the host applies to its copy of the part it serves.
        dtensor_sync(self, "patches")

    def test_a_served_module_receives_every_kind_of_tensor_bit_exact(self):
        # The host stages a chunk's small tensors in one buffer, in order,
        # each at a 16-byte boundary, and makes each one's view (from its
        # kind's dtype and shape) as load_weights reads it; a large one gets
        # its own. Sizes that are no multiple of 16, kinds interleaved,
        # scalars, empty tensors and two above the small limit all land
        # where they belong.
        import wtx
        g = torch.Generator().manual_seed(7)
        weights = {}
        for i in range(60):  # three kinds, interleaved, 12, 10 and 48 bytes
            weights[f"f3.{i}"] = torch.randn(3, generator=g)
            weights[f"h5.{i}"] = torch.randn(5, generator=g).to(torch.bfloat16)
            weights[f"m.{i}"] = torch.randn(2, 6, generator=g)
        weights.update({
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "flags": torch.tensor([True, False, True]),
            "fp8": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.tensor([-(2 ** 40), 3]), "large": torch.randn(70_000, generator=g),
            "large.too": torch.randn(20_000, generator=g)})  # two of their own in one chunk
        host = BufferHost(weights)
        model = host.inner
        with wtx.serve(host, "127.0.0.1:0") as server:
            c = wtx.WorkerClient([server.address])
            for step in (1, 2):  # the second names the tensors by position
                e = wtx.TrainerEngine.trainer_init({"rank": 0, "buffer_size": 1 << 20},
                                                   client=c, source=wtx.DictSource(weights))
                e.send_weights(version=f"v{step}")
                e.shutdown()
                for name, t in weights.items():
                    got = getattr(model, name.replace(".", "_"))
                    self.assertEqual(t.reshape(-1).view(torch.uint8).tolist(),
                                     got.reshape(-1).view(torch.uint8).tolist(), name)
                weights = {n: (t.float() + 1).to(t.dtype) if t.is_floating_point() else t
                           for n, t in weights.items()}
            c.close()

    def test_runs_of_one_kind_reach_a_served_module_bit_exact(self):
        # The host makes the views of a run of small tensors of one kind in
        # the buffer (each a 16-byte step after the last) in one call:
        # runs longer than it makes at once, runs broken by another kind,
        # and runs of one, each tensor where it belongs.
        import wtx
        g = torch.Generator().manual_seed(11)
        weights = {f"a.{i}": torch.randn(3, generator=g) for i in range(2500)}  # 12 of 16 bytes
        weights.update({f"b.{i}": torch.randn(5, generator=g).to(torch.bfloat16) for i in range(3)})
        weights["c"] = torch.randn(3, generator=g)
        weights["d"] = torch.randn(2, 2, generator=g)
        weights.update({f"e.{i}": torch.randn(3, generator=g) for i in range(2)})
        host = BufferHost(weights)
        model = host.inner
        with wtx.serve(host, "127.0.0.1:0") as server:
            c = wtx.WorkerClient([server.address])
            e = wtx.TrainerEngine.trainer_init({"rank": 0, "buffer_size": 1 << 20}, client=c,
                                               source=wtx.DictSource(weights))
            e.send_weights()
            e.shutdown()
            c.close()
        for name, t in weights.items():
            got = getattr(model, name.replace(".", "_"))
            self.assertEqual(t.shape, got.shape, name)
            self.assertTrue(torch.equal(t, got), name)

    def test_a_tensor_larger_than_the_buffer_reaches_a_served_module_whole(self):
        # The chunk after the first holds the rest of the large tensor and
        # then new ones: the host stages only the new ones there (one
        # stage_chunk call per chunk), and the large tensor arrives whole.
        import wtx
        model = torch.nn.ParameterDict({
            "big": torch.nn.Parameter(torch.zeros(400_000)),
            "a": torch.nn.Parameter(torch.zeros(5)), "b": torch.nn.Parameter(torch.zeros(7))})
        with wtx.serve(model, "127.0.0.1:0") as server:
            c = wtx.WorkerClient([server.address])
            for step in (1, 2):  # the second names the tensors by position
                weights = {"big": torch.arange(400_000, dtype=torch.float32) * step,
                           "a": torch.full((5,), 1.0 * step), "b": torch.full((7,), 2.0 * step)}
                e = wtx.TrainerEngine.trainer_init({"rank": 0, "buffer_size": 1 << 20},
                                                   client=c, source=wtx.DictSource(weights))
                r = e.send_weights()
                e.shutdown()
                self.assertEqual(2, r["chunks"])
                for name, t in weights.items():
                    self.assertTrue(torch.equal(model[name].detach(), t), f"{name}, update {step}")
            c.close()

    def test_a_load_weights_that_raises_is_named_and_the_weights_stay(self):
        # The host's commit fails: the trainer hears that, once (a status it
        # would retry into an update already ended would hide the cause),
        # and the module keeps the version it had; the next push lands.
        import wtx
        model = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.zeros(4))})

        class Refusing(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner, self.refuse = inner, False

            def load_weights(self, items):
                if self.refuse:
                    raise ValueError("test: this host refuses")
                for name, t in items:
                    self.inner[name].copy_(t)

        host = Refusing(model)
        with wtx.serve(host, "127.0.0.1:0") as server:
            c = wtx.WorkerClient([server.address])

            def push(version, value):
                e = wtx.TrainerEngine.trainer_init({"rank": 0}, client=c, source=wtx.DictSource(
                    {"a": torch.full((4,), value)}))
                try:
                    e.send_weights(version=version)
                finally:
                    e.shutdown()

            push("v1", 1.0)
            host.refuse = True
            with self.assertRaises(wtx.WtxError) as e:
                push("v2", 2.0)
            self.assertIn("commit failed", str(e.exception))
            self.assertNotIn("without an active update", str(e.exception))
            self.assertEqual("v1", server.version)
            self.assertTrue(torch.equal(model["a"].detach(), torch.full((4,), 1.0)))
            host.refuse = False
            push("v3", 3.0)
            self.assertEqual("v3", server.version)
            self.assertTrue(torch.equal(model["a"].detach(), torch.full((4,), 3.0)))
            c.close()

    def test_a_host_narrowing_loads_stages_only_what_its_loader_reads(self):
        # serve(narrow_loads=True), as the vLLM plugin's tensor-parallel
        # ranks: the trainer sends whole tensors, and the host keeps of each
        # what load_weights reads. "col": rows 128..255 (a narrow); "expert":
        # nothing (another rank's); "scaled": whole (the loader computes on
        # it). At commit, a loader that reads beyond what it read when
        # learned fails the commit, and the weights stay.
        import wtx
        full = {"col": torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128),
                "expert": torch.ones(256, 128), "scaled": torch.full((256, 128), 3.0)}

        class Rank(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.col = torch.nn.Parameter(torch.zeros(128, 128))
                self.scaled = torch.nn.Parameter(torch.zeros(256, 128))
                self.start = 128

            def load_weights(self, items):
                for name, t in items:
                    if name == "col":
                        self.col.data.copy_(t.narrow(0, self.start, 128))
                    elif name == "scaled":
                        self.scaled.data.copy_(t * 2)

        host = Rank()
        with wtx.serve(host, "127.0.0.1:0", narrow_loads=True) as server:
            c = wtx.WorkerClient([server.address])

            def push(version):
                e = wtx.TrainerEngine.trainer_init(
                    {"rank": 0, "buffer_size": 128 << 10}, client=c, source=wtx.DictSource(full))
                try:
                    e.send_weights(version=version)
                finally:
                    e.shutdown()

            push("v1")
            self.assertTrue(torch.equal(host.col.detach(), full["col"][128:]))
            self.assertTrue(torch.equal(host.scaled.detach(), full["scaled"] * 2))
            # One 128 KiB tensor a chunk, each cut down once the next is
            # staged: never all three whole (384 KiB) at once.
            self.assertLessEqual(server.staged_peak_bytes, 192 << 10)
            host.start = 0
            full["col"] = full["col"] + 1
            with self.assertRaisesRegex(wtx.WtxError, "commit failed"):
                push("v2")
            self.assertEqual("v1", server.version)
            self.assertTrue(torch.equal(host.col.detach(), full["col"][128:] - 1))
            c.close()

    def test_dtypes_map_both_ways(self):
        from wtx import _dtypes
        for wire, (name, size, st) in _dtypes.WIRE.items():
            dt = _dtypes.to_torch(wire)
            self.assertEqual(wire, _dtypes.to_wire(dt))
            self.assertEqual(wire, _dtypes.to_wire(st))
            self.assertEqual(size, torch.empty(0, dtype=dt).element_size())
        with self.assertRaisesRegex(ValueError, "complex64"):
            _dtypes.to_wire(torch.complex64)

    def test_only_tensors_held_elsewhere_are_sent_from_their_own_memory(self):
        # The C source API's 2 (sent from there, no copy, referenced until
        # the pass ends) only where the bytes are the tensor's own and the
        # tensor lives on anyway (a parameter, a DictSource's); a copy,
        # held for one tensor, for anything else (a gathered DTensor, a
        # transposed view), so a pass never holds a second model.
        import numpy as np
        import wtx
        from wtx.sources import COPY, OWN_HOST, held_elsewhere, host_view
        t = torch.arange(12.)
        addr, n, keep, kind = host_view("t", t)
        self.assertEqual((t.data_ptr(), 48, OWN_HOST), (addr, n, kind))
        self.assertEqual(COPY, host_view("tt", t.reshape(3, 4).t())[3])
        a = np.arange(6, dtype=np.float32)
        self.assertEqual(OWN_HOST, host_view("a", a)[3])
        self.assertEqual(COPY, host_view("at", a.reshape(2, 3).T)[3])
        module = torch.nn.Linear(4, 2)
        self.assertTrue(held_elsewhere(wtx.TorchModuleSource(module), module.weight))
        self.assertFalse(held_elsewhere(wtx.TorchModuleSource(module), module.weight * 2))
        self.assertTrue(held_elsewhere(wtx.DictSource({"t": t}), t))

if __name__ == "__main__":
    unittest.main(verbosity=2)
