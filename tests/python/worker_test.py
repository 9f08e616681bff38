"""wtx-worker driven from Python's grpcio (PyPI): the server speaks to other
languages. Stubs are generated from proto/ with grpcio-tools at test time;
reflection and health are asked exactly as grpcurl and Kubernetes do; the
published safetensors file is read back by Hugging Face's own parser.

Run by tests/python/run.sh (Bazel: //tests/python:worker_test) with
WTX_WORKER (the binary) and WTX_PROTO_ROOT (the directory holding wtx/v1/).
"""
import http.server
import json
import math
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
import uuid

import grpc
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_tools import protoc
import safetensors

WORKER = os.environ["WTX_WORKER"]
CLI = os.environ["WTX_CLI"]
PROTO_ROOT = os.environ["WTX_PROTO_ROOT"]
GEN = tempfile.mkdtemp(prefix="wtx-py-")


def generate_stubs():
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    files = [os.path.join(PROTO_ROOT, "wtx/v1", f)
             for f in ("types.proto", "transport.proto", "weight_transfer.proto")]
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                      f"--python_out={GEN}", f"--grpc_python_out={GEN}", *files])
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with {rc}")
    sys.path.insert(0, GEN)


generate_stubs()
from wtx.v1 import transport_pb2, types_pb2, weight_transfer_pb2 as wt  # noqa: E402
from wtx.v1 import weight_transfer_pb2_grpc as wt_grpc  # noqa: E402


def metrics_address():
    """A loopback address for a worker's --metrics-listen."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % probe.getsockname()[1]
    probe.close()
    return addr


def wait_running(metrics, op, seconds=10):
    """Until the worker's gauge says one `op` call (init, update, ...) is
    running on it, not only sent: False when it did not within seconds."""
    running = 'wtx_rl_weight_update_operations_in_flight{operation="%s"} 1' % op
    deadline = time.time() + seconds
    while time.time() < deadline:  # each look is a scrape: the worker's own pace
        if running in urllib.request.urlopen(f"http://{metrics}/metrics", timeout=2).read().decode():
            return True
    return False


class Worker:
    """One wtx-worker process on a free loopback port."""

    def __init__(self, *args):
        self.dir = tempfile.mkdtemp(prefix="wtx-worker-")
        port_file = os.path.join(self.dir, "port")
        with open(os.path.join(self.dir, "log"), "w") as log:
            self.proc = subprocess.Popen(
                [WORKER, "--listen", "127.0.0.1:0", "--port-file", port_file,
                 *args], stderr=log)
        deadline = time.time() + 10
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("wtx-worker did not start: " + self.log())
            time.sleep(0.02)
        with open(port_file) as f:
            self.port = int(f.read())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def log(self):
        with open(os.path.join(self.dir, "log")) as f:
            return f.read()

    def stop(self):
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=10)


def f32_tensor(name, values):
    data = b"".join(int(v).to_bytes(4, "little") for v in values)
    return name, data


class Shm:
    """A POSIX shared-memory object the worker reads chunks from."""

    def __init__(self, size):
        self.name = f"/wtx-py-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = "/dev/shm" + self.name
        with open(self.path, "wb") as f:
            f.truncate(size)
        self.f = open(self.path, "r+b")
        self.map = mmap.mmap(self.f.fileno(), size)

    def close(self):
        self.map.close()
        self.f.close()
        os.unlink(self.path)


class WorkerTest(unittest.TestCase):
    def setUp(self):
        self.spec_dir = tempfile.mkdtemp(prefix="wtx-pub-")
        self.w = Worker("--publish-dir", self.spec_dir)
        self.stub = wt_grpc.WeightTransferStub(self.w.channel)

    def tearDown(self):
        self.assertEqual(0, self.w.stop(), self.w.log())

    def test_health_is_serving(self):
        stub = health_pb2_grpc.HealthStub(self.w.channel)
        for service in ("", "wtx.v1.WeightTransfer"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service))
            self.assertEqual(health_pb2.HealthCheckResponse.SERVING, resp.status)
        with self.assertRaises(grpc.RpcError) as cm:
            stub.Check(health_pb2.HealthCheckRequest(service="no.Such"))
        self.assertEqual(grpc.StatusCode.NOT_FOUND, cm.exception.code())

    def test_reflection_describes_and_calls_like_grpcurl(self):
        # grpcurl list / describe: services and full descriptors (imports
        # included) from the server alone, no .proto files on this side.
        db = ProtoReflectionDescriptorDatabase(self.w.channel)
        services = set(db.get_services())
        self.assertTrue({"wtx.v1.WeightTransfer", "grpc.health.v1.Health",
                         "grpc.reflection.v1.ServerReflection",
                         "grpc.reflection.v1alpha.ServerReflection"} <= services,
                        services)
        pool = descriptor_pool.DescriptorPool(db)
        svc = pool.FindServiceByName("wtx.v1.WeightTransfer")
        methods = {m.name for m in svc.methods}
        self.assertTrue({"InitWeightTransferEngine", "StartWeightUpdate",
                         "UpdateWeights", "FinishWeightUpdate",
                         "GetWeightInfo"} <= methods, methods)
        meta = pool.FindMessageTypeByName("wtx.v1.ParamMeta")
        self.assertEqual("wtx/v1/types.proto", meta.file.name)
        # grpcurl -d '{...}' : a JSON body turned into a message whose type
        # came from reflection, sent as bytes.
        m = svc.methods_by_name["GetWorldSize"]
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        call = self.w.channel.unary_unary(
            "/wtx.v1.WeightTransfer/GetWorldSize",
            request_serializer=lambda x: x.SerializeToString(),
            response_deserializer=resp_cls.FromString)
        resp = call(json_format.Parse("{}", req_cls()))
        self.assertEqual({"worldSize": 1}, json_format.MessageToDict(resp))

    def grpcurl(self, *args, body=None):
        exe = os.path.join(os.path.dirname(sys.executable), "grpcurl")
        cmd = [exe, "-plaintext", *(["-d", body] if body is not None else []),
               f"127.0.0.1:{self.w.port}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    def test_grpcurl_lists_describes_and_calls(self):
        # The real grpcurl (1.8.6), as an operator runs it.
        out = self.grpcurl("list")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual(["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                          "grpc.reflection.v1alpha.ServerReflection",
                          "wtx.v1.WeightTransfer"], sorted(out.stdout.split()))
        out = self.grpcurl("describe", "wtx.v1.InitInfo")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn(".wtx.v1.ShmInitInfo shm", out.stdout)
        out = self.grpcurl("wtx.v1.WeightTransfer/GetWorldSize", body="{}")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual({"worldSize": 1}, json.loads(out.stdout))
        out = self.grpcurl("wtx.v1.WeightTransfer/GetWeightInfo",
                           body='{"include_params": true}')
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual("SESSION_STATE_UNINITIALIZED", json.loads(out.stdout)["state"])
        out = self.grpcurl("grpc.health.v1.Health/Check")
        self.assertEqual({"status": "SERVING"}, json.loads(out.stdout))
        out = self.grpcurl("wtx.v1.WeightTransfer/InitWeightTransferEngine",
                           body='{"init_info": {"shm": {}}}')
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual("shm", json.loads(out.stdout)["backend"])
        out = self.grpcurl("wtx.v1.WeightTransfer/StartWeightUpdate",
                           body='{"session_id": "nope"}')
        self.assertNotEqual(0, out.returncode)
        self.assertIn("Code: NotFound", out.stderr)
        self.assertIn("session_id", out.stderr)

    def test_full_session_over_shm(self):
        tensors = [f32_tensor("model.layers.0.w", range(1000)),
                   f32_tensor("model.layers.1.w", range(5000, 5300)),
                   f32_tensor("lm_head.weight", [7] * 64)]
        total = sum(len(d) for _, d in tensors)
        init = self.stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
        self.assertEqual("shm", init.backend)
        self.assertEqual(32, len(init.session_id))

        # Refusals carry the right code and name the problem.
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.UpdateWeights(wt.UpdateWeightsRequest(
                session_id=init.session_id, update_id=1))
        self.assertEqual(grpc.StatusCode.FAILED_PRECONDITION, cm.exception.code())

        start = self.stub.StartWeightUpdate(wt.StartWeightUpdateRequest(
            session_id=init.session_id))
        shm = Shm(total)
        try:
            # Two chunks: the first two tensors, then the last one.
            off = 0
            for chunk in (tensors[:2], tensors[2:]):
                begin = off
                params, sums = [], []
                for name, data in chunk:
                    shm.map[off:off + len(data)] = data
                    off += len(data)
                    params.append(types_pb2.ParamMeta(
                        name=name, dtype=types_pb2.DTYPE_FLOAT32,
                        shape=[len(data) // 4]))
                    sums.append(xxhash.xxh3_64_intdigest(data))
                resp = self.stub.UpdateWeights(wt.UpdateWeightsRequest(
                    session_id=init.session_id, update_id=start.update_id,
                    update_info=wt.UpdateInfo(
                        params=params, chunk_bytes=off - begin, xxh3_64=sums,
                        shm=transport_pb2.ShmUpdateInfo(region=shm.name, offset=begin))))
            self.assertEqual(3, resp.staged_params)
            self.assertEqual(total, resp.staged_bytes)
            fin = self.stub.FinishWeightUpdate(wt.FinishWeightUpdateRequest(
                session_id=init.session_id, update_id=start.update_id,
                weight_version="py-1"))
            self.assertEqual("py-1", fin.weight_version)
        finally:
            shm.close()

        info = self.stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True))
        self.assertEqual("py-1", info.weight_version)
        got = {p.meta.name: p.xxh3_64 for p in info.params}
        self.assertEqual({n: xxhash.xxh3_64_intdigest(d) for n, d in tensors}, got)

        # The published file, read by the safetensors package itself.
        latest = os.path.join(self.spec_dir, "LATEST")
        deadline = time.time() + 10
        while not os.path.exists(latest) and time.time() < deadline:
            time.sleep(0.02)
        with open(latest) as f:
            name = f.read().strip()
        self.assertEqual("py-1.safetensors", name)
        with open(os.path.join(self.spec_dir, name), "rb") as f:
            raw = f.read()
        loaded = {n: t for n, t in safetensors.deserialize(raw)}
        self.assertEqual({n for n, _ in tensors}, set(loaded))
        for n, d in tensors:
            self.assertEqual("F32", loaded[n]["dtype"])
            self.assertEqual([len(d) // 4], loaded[n]["shape"])
            self.assertEqual(d, bytes(loaded[n]["data"]))
        header_len = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + header_len])["__metadata__"]
        self.assertEqual("py-1", meta["wtx_version"])


    def test_wtx_push_of_a_file_written_by_the_safetensors_package(self):
        # An independent writer (Hugging Face's safetensors), wtx's reader.
        import ctypes
        tensors = {
            "model.layers.0.mlp.up_proj.weight": ("bfloat16", [1024, 1536]),
            "model.layers.0.input_layernorm.weight": ("float32", [1024]),
            "model.embed_tokens.weight": ("float16", [300, 64]),
            "lm_head.scales": ("int8", [7, 3]),
            "model.norm.weight": ("float32", []),
        }
        size = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1}
        raw, keep, specs = {}, [], {}
        for i, (name, (dt, shape)) in enumerate(tensors.items()):
            n = size[dt]
            for d in shape:
                n *= d
            data = bytes((j * 7 + i) & 0xFF for j in range(n)) if n < 100000 \
                else os.urandom(n)
            raw[name] = data
            buf = ctypes.create_string_buffer(data, len(data))
            keep.append(buf)
            specs[name] = safetensors.TensorSpec(
                dtype=dt, shape=shape, data_ptr=ctypes.addressof(buf), data_len=n)
        path = os.path.join(self.w.dir, "model.safetensors")
        safetensors.serialize_file(specs, path, metadata={"format": "pt"})
        out = subprocess.run(
            [CLI, "push", "--workers", f"127.0.0.1:{self.w.port}", "--backend", "tcp",
             "--buffer-size", "1M", "--version", "hf-1", "--verify", path],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn("verified: 5 checksums equal on 1 worker(s)", out.stdout)
        info = self.stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True))
        self.assertEqual("hf-1", info.weight_version)
        got = {p.meta.name: (p.xxh3_64, list(p.meta.shape)) for p in info.params}
        want = {n: (xxhash.xxh3_64_intdigest(d), tensors[n][1]) for n, d in raw.items()}
        self.assertEqual(want, got)

    def test_wtx_version_relabels_and_wtx_abort_ends_an_open_update(self):
        # The operator's two verbs, as the CLI's help says them.
        w = f"127.0.0.1:{self.w.port}"
        run = lambda *a: subprocess.run([CLI, *a], capture_output=True, text=True, timeout=60)
        out = run("push", "--workers", w, "--version", "v1", "synthetic:1M")
        self.assertEqual(0, out.returncode, out.stderr)
        out = run("version", w, "relabelled")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn("version relabelled (was v1) on 1 worker(s)", out.stdout)
        info = self.stub.GetWeightInfo(wt.GetWeightInfoRequest())
        self.assertEqual(("relabelled", 1), (info.weight_version, info.generation))
        out = run("abort", w, "nothing open")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn("no update was active", out.stdout)
        # An update left open by a trainer: aborted, the weights kept.
        init = self.stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
        self.stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
        self.assertEqual(wt.SESSION_STATE_UPDATING,
                         self.stub.GetWeightInfo(wt.GetWeightInfoRequest()).state)
        out = run("abort", w, "operator says stop")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertNotIn("no update was active", out.stdout)
        info = self.stub.GetWeightInfo(wt.GetWeightInfoRequest())
        self.assertEqual(wt.SESSION_STATE_READY, info.state)
        self.assertEqual(("relabelled", 1), (info.weight_version, info.generation))
        self.assertIn("operator says stop", self.w.log())

    def test_the_listing_pages_under_4_mib_near_16384_params_with_1_kib_names(self):
        # GetWeightInfo with include_params, as grpcurl or any client with
        # gRPC's default 4 MiB receive limit asks it: every page fits, and
        # the pages list every parameter once, in order.
        n = 16384 + 700
        names = ["p%05d." % i + "x" * (1024 - 7) for i in range(n)]  # 1024 bytes each
        header = {name: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                  for i, name in enumerate(names)}
        blob = json.dumps(header).encode()
        path = os.path.join(self.w.dir, "wide.safetensors")
        with open(path, "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob + bytes(4 * n))
        out = subprocess.run([CLI, "push", "--workers", f"127.0.0.1:{self.w.port}", path],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(0, out.returncode, out.stderr)
        listed, offset, pages = [], 0, 0
        while True:
            resp = self.stub.GetWeightInfo(wt.GetWeightInfoRequest(
                include_params=True, params_offset=offset))
            self.assertLessEqual(len(resp.SerializeToString()), 4 << 20)
            self.assertLessEqual(len(resp.params), 16384)
            listed += [p.meta.name for p in resp.params]
            pages += 1
            offset = resp.next_params_offset
            if offset == 0:
                break
            self.assertEqual(len(listed), offset)
        self.assertEqual(names, listed)
        self.assertGreater(pages, 1)

    def test_wtx_push_repeat_syncs_from_one_trainer(self):
        # --repeat N: N syncs in a row from one trainer, each published and
        # verified, a summary line each; --version names one sync only.
        w = f"127.0.0.1:{self.w.port}"
        before = self.stub.GetWeightInfo(wt.GetWeightInfoRequest()).generation
        out = subprocess.run([CLI, "push", "--workers", w, "--repeat", "3", "--verify",
                              "synthetic:1M"], capture_output=True, text=True, timeout=60)
        self.assertEqual(0, out.returncode, out.stderr)
        pushed = [l for l in out.stdout.splitlines() if l.startswith("pushed ")]
        self.assertEqual(3, len(pushed), out.stdout)
        self.assertEqual([f"version {before + i}" for i in (1, 2, 3)],
                         [l[l.rindex("version "):] for l in pushed])
        self.assertEqual(3, out.stdout.count("verified: 82 checksums equal on 1 worker(s)"))
        info = self.stub.GetWeightInfo(wt.GetWeightInfoRequest())
        self.assertEqual(before + 3, info.generation)
        for flags, want in [(["--repeat", "2", "--version", "v"], "--version names one sync"),
                            (["--repeat", "0"], "--repeat: '0' is not valid"),
                            (["--repeat", "1001"], "--repeat: '1001' is not valid")]:
            out = subprocess.run([CLI, "push", "--workers", w] + flags + ["synthetic:1M"],
                                 capture_output=True, text=True, timeout=30)
            self.assertEqual(2, out.returncode, out.stderr)
            self.assertIn(want, out.stderr)
        self.assertEqual(before + 3,
                         self.stub.GetWeightInfo(wt.GetWeightInfoRequest()).generation)

    def test_a_nul_inside_a_name_is_refused(self):
        # protobuf-c keeps C strings: a NUL would silently cut the name.
        init = self.stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
        start = self.stub.StartWeightUpdate(
            wt.StartWeightUpdateRequest(session_id=init.session_id))
        ui = wt.UpdateInfo(
            params=[types_pb2.ParamMeta(name="a\x00b", dtype=types_pb2.DTYPE_UINT8,
                                        shape=[4])],
            shm=transport_pb2.ShmUpdateInfo(region="/wtx-none"))
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.UpdateWeights(wt.UpdateWeightsRequest(
                session_id=init.session_id, update_id=start.update_id, update_info=ui))
        self.assertEqual(grpc.StatusCode.INVALID_ARGUMENT, cm.exception.code())
        self.assertIn("a string holds a NUL byte", cm.exception.details())

    def test_wtx_push_refuses_what_it_cannot_honour(self):
        # An unreadable TLS file, a client certificate without its key and
        # more workers than the limit are errors, never a silent plaintext
        # session or a dropped worker.
        w = f"127.0.0.1:{self.w.port}"
        cases = [
            (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read /nonexistent/ca.pem"),
            (["--tls-ca", CLI, "--tls-cert", "/nonexistent/c.pem"],
             "--tls-cert: cannot read /nonexistent/c.pem"),
            (["--tls-ca", CLI, "--tls-cert", CLI],
             "tls: tls_cert_pem and tls_key_pem go together"),
        ]
        for flags, want in cases:
            out = subprocess.run([CLI, "push", "--workers", w] + flags + ["synthetic:1M"],
                                 capture_output=True, text=True, timeout=30)
            self.assertEqual(2, out.returncode, out.stderr)
            self.assertIn(want, out.stderr)
        many = ",".join([w] * 257)
        out = subprocess.run([CLI, "push", "--workers", many, "synthetic:1M"],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(2, out.returncode, out.stderr)
        self.assertIn("workers: 257 given, must be 1..256", out.stderr)
        info = self.stub.GetWeightInfo(wt.GetWeightInfoRequest())
        self.assertEqual(0, info.generation)  # nothing was pushed


class BlockingVllm:
    """A STAND-IN for a vLLM server's HTTP routes as wtx-worker --vllm-url
    calls them: every route answers 200 at once, except the reload
    (/collective_rpc) while block is set: it sets reloading, then answers
    only once close() is called. What it holds up is a call into the host
    that nothing in the worker can cancel."""

    def __init__(self):
        self.block = False
        self.reloading = threading.Event()
        self.released = threading.Event()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.startswith("/collective_rpc") and stand_in.block:
                    stand_in.reloading.set()
                    stand_in.released.wait(120)
                self.answer({})

            def do_GET(self):
                self.answer({"weight_version": "", "is_paused": False})

            def answer(self, body):
                data = json.dumps(body).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the worker asking is gone (it was made to exit)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]

    def close(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


class DrainTest(unittest.TestCase):
    def test_a_host_call_that_never_returns_is_cut_short_after_the_grace_period(self):
        # Finish waiting on vLLM's reload (the sidecar bridge), which does not
        # answer: no drain can cancel that. The worker exits anyway, 0, once
        # --grace-ms and one more second are up, and says so; --publish-dir
        # holds whole versions only, whichever LATEST names.
        vllm = BlockingVllm()
        self.addCleanup(vllm.close)
        pub = tempfile.mkdtemp(prefix="wtx-pub-")
        w = Worker("--publish-dir", pub, "--grace-ms", "500", "--vllm-url", vllm.url,
                   "--vllm-dir", tempfile.mkdtemp(prefix="wtx-vllm-"),
                   "--vllm-timeout-ms", "600000")  # only the forced exit ends the wait
        self.addCleanup(lambda: w.proc.poll() is None and w.proc.kill())
        self.addCleanup(w.channel.close)
        addr = f"127.0.0.1:{w.port}"
        stub = wt_grpc.WeightTransferStub(w.channel)
        sums = {}
        out = subprocess.run([CLI, "push", "--workers", addr, "--version", "v1", "synthetic:1M"],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(0, out.returncode, out.stderr)
        params = stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True)).params
        sums["v1"] = {p.meta.name: p.xxh3_64 for p in params}
        vllm.block = True
        push = subprocess.Popen([CLI, "push", "--workers", addr, "--version", "v2",
                                 "synthetic:1M"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.addCleanup(push.wait)
        self.addCleanup(push.kill)  # the trainer's retries are not what this tests
        self.assertTrue(vllm.reloading.wait(30), w.log())  # Finish is inside the host call
        info = stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True), timeout=5)
        self.assertEqual("v2", info.weight_version)  # committed; vLLM has not answered
        sums["v2"] = {p.meta.name: p.xxh3_64 for p in info.params}
        t0 = time.time()
        w.proc.send_signal(signal.SIGTERM)
        self.assertEqual(0, w.proc.wait(timeout=10), w.log())
        self.assertLess(time.time() - t0, 0.5 + 1.5)  # --grace-ms + 1 s, and some slack
        self.assertIn("event=forced_exit", w.log())
        with open(os.path.join(pub, "LATEST")) as f:
            name = f.read().strip()
        version = name[:-len(".safetensors")]
        self.assertIn(version, sums)
        with open(os.path.join(pub, name), "rb") as f:
            raw = f.read()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        self.assertEqual(version, header["__metadata__"]["wtx_version"])
        got = {n: xxhash.xxh3_64_intdigest(bytes(t["data"]))
               for n, t in safetensors.deserialize(raw)}
        self.assertEqual(sums[version], got)

    def test_sigterm_while_prepared_keeps_the_published_version_whole(self):
        # An update staged and prepared, not finished, when SIGTERM comes:
        # the worker aborts it, exits 0, and what --publish-dir holds is
        # still the last published version, whole.
        pub = tempfile.mkdtemp(prefix="wtx-pub-")
        w = Worker("--publish-dir", pub, "--grace-ms", "500")
        addr = f"127.0.0.1:{w.port}"
        out = subprocess.run([CLI, "push", "--workers", addr, "--version", "v1", "synthetic:1M"],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(0, out.returncode, out.stderr)
        stub = wt_grpc.WeightTransferStub(w.channel)
        meta = stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True)).params[0].meta
        size = 2 * math.prod(meta.shape)  # bf16
        data = bytes((i * 13) & 0xFF for i in range(size))
        init = stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
        start = stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
        shm = Shm(size)
        try:
            shm.map[:size] = data
            stub.UpdateWeights(wt.UpdateWeightsRequest(
                session_id=init.session_id, update_id=start.update_id,
                update_info=wt.UpdateInfo(params=[meta], chunk_bytes=size,
                                          xxh3_64=[xxhash.xxh3_64_intdigest(data)],
                                          shm=transport_pb2.ShmUpdateInfo(region=shm.name))))
        finally:
            shm.close()
        stub.PrepareWeightUpdate(wt.PrepareWeightUpdateRequest(
            session_id=init.session_id, update_id=start.update_id, weight_version="v2"))
        self.assertEqual(wt.SESSION_STATE_PREPARED,
                         stub.GetWeightInfo(wt.GetWeightInfoRequest()).state)
        w.proc.send_signal(signal.SIGTERM)
        self.assertEqual(0, w.proc.wait(timeout=10), w.log())
        w.channel.close()
        with open(os.path.join(pub, "LATEST")) as f:
            self.assertEqual("v1.safetensors", f.read().strip())
        with open(os.path.join(pub, "v1.safetensors"), "rb") as f:
            raw = f.read()
        loaded = dict(safetensors.deserialize(raw))
        self.assertEqual(size, len(bytes(loaded[meta.name]["data"])))
        self.assertNotEqual(data, bytes(loaded[meta.name]["data"]))  # v1's, not v2's
        self.assertFalse(os.path.exists(os.path.join(pub, "v2.safetensors")))

    def test_a_sigterm_as_soon_as_the_worker_serves_drains_it(self):
        # As a rollout may: the port file says the worker serves, and
        # SIGTERM follows at once (the file is watched without a pause).
        # Its handler is in place by then: it drains and exits 0.
        d = tempfile.mkdtemp(prefix="wtx-term-")
        for i in range(20):
            port_file = os.path.join(d, f"port{i}")
            proc = subprocess.Popen([WORKER, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                     "--log-level", "error"])
            deadline = time.time() + 10
            while not os.path.exists(port_file) and time.time() < deadline:
                pass
            proc.send_signal(signal.SIGTERM)
            self.assertEqual(0, proc.wait(timeout=10), f"start {i}")

    def test_sigterm_ends_a_blocked_receive_within_the_grace_period(self):
        # An upstream that accepts the worker, then never sends the chunk.
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        metrics = metrics_address()
        w = Worker("--grace-ms", "500", "--metrics-listen", metrics)
        stub = wt_grpc.WeightTransferStub(w.channel)
        init = stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(
                tcp=transport_pb2.TcpInitInfo(
                    upstream_address="127.0.0.1:%d" % lsock.getsockname()[1],
                    data_token=b"t" * 16),
                timeout_ms=3600000)))  # an hour: only the drain can end it
        conn, _ = lsock.accept()
        start = stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
        ui = wt.UpdateInfo(params=[types_pb2.ParamMeta(name="w", dtype=types_pb2.DTYPE_UINT8,
                                                       shape=[64])],
                           tcp=transport_pb2.TcpUpdateInfo())
        call = stub.UpdateWeights.future(wt.UpdateWeightsRequest(
            session_id=init.session_id, update_id=start.update_id, update_info=ui))
        self.assertTrue(wait_running(metrics, "update"))  # running there, not only sent
        info = stub.GetWeightInfo(wt.GetWeightInfoRequest(), timeout=2)  # not blocked
        self.assertEqual(wt.SESSION_STATE_UPDATING, info.state)
        t0 = time.time()
        w.proc.send_signal(signal.SIGTERM)
        self.assertEqual(0, w.proc.wait(timeout=10))
        self.assertLess(time.time() - t0, 0.5 + 1.0)  # --grace-ms + 1 s
        with self.assertRaises(grpc.RpcError):
            call.result(timeout=5)
        w.channel.close()
        conn.close()
        lsock.close()


class SecuredWorkerTest(unittest.TestCase):
    """A worker behind a bearer token and TLS, reached as README shows."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="wtx-tls-")
        d = self.dir
        run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=wtx-test-ca", "-keyout", "ca.key", "-out", "ca.pem")
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
            "-keyout", "srv.key", "-out", "srv.csr")
        with open(os.path.join(d, "san.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost")
        run("openssl", "x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "srv.pem")
        with open(os.path.join(d, "token"), "w") as f:
            f.write("s3cr3t-t0ken\n")
        self.w = Worker("--token-file", os.path.join(d, "token"),
                        "--tls-cert", os.path.join(d, "srv.pem"),
                        "--tls-key", os.path.join(d, "srv.key"))

    def tearDown(self):
        self.assertEqual(0, self.w.stop())

    def grpcurl(self, *args, token=None, body=None):
        exe = os.path.join(os.path.dirname(sys.executable), "grpcurl")
        cmd = [exe, "-cacert", os.path.join(self.dir, "ca.pem"),
               *(["-H", f"authorization: Bearer {token}"] if token else []),
               *(["-d", body] if body is not None else []),
               f"127.0.0.1:{self.w.port}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    def test_grpcurl_over_tls_with_the_token(self):
        out = self.grpcurl("list")  # reflection is open by default
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn("wtx.v1.WeightTransfer", out.stdout.split())
        out = self.grpcurl("wtx.v1.WeightTransfer/GetWorldSize", body="{}")
        self.assertNotEqual(0, out.returncode)
        self.assertIn("Code: Unauthenticated", out.stderr)
        out = self.grpcurl("wtx.v1.WeightTransfer/GetWorldSize", body="{}",
                           token="s3cr3t-t0ken")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual({"worldSize": 1}, json.loads(out.stdout))
        out = self.grpcurl("grpc.health.v1.Health/Check")  # probes need no token
        self.assertEqual({"status": "SERVING"}, json.loads(out.stdout))

    def test_wtx_cli_over_tls_with_a_token_from_the_environment(self):
        addr = f"127.0.0.1:{self.w.port}"
        ca = os.path.join(self.dir, "ca.pem")
        env = dict(os.environ, WTX_TOKEN="s3cr3t-t0ken")
        out = subprocess.run([CLI, "push", "--workers", addr, "--tls-ca", ca,
                              "--version", "secure-1", "--verify", "synthetic:1M"],
                             capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(0, out.returncode, out.stderr)
        out = subprocess.run([CLI, "info", addr, "--tls-ca", ca, "--token-file",
                              os.path.join(self.dir, "token")],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn("version secure-1", out.stdout)
        out = subprocess.run([CLI, "info", addr, "--tls-ca", ca, "--token", "wrong"],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(1, out.returncode)
        self.assertIn("UNAUTHENTICATED", out.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
