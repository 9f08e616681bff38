"""wtx-worker --metrics-listen: GET /metrics in the Prometheus text format,
parsed with prometheus_client's own parser during and after syncs. The
operation histogram has vLLM's name pattern, labels and bucket edges."""
import math
import socket
import subprocess
import threading
import time
import unittest
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from worker_test import CLI, Worker

VLLM_BUCKETS = ["0.01", "0.1", "1", "10", "30", "60", "120", "300", "600", "+Inf"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def scrape(port):
    """{(name, labels as a sorted tuple): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class MetricsTest(unittest.TestCase):
    def setUp(self):
        self.mport = free_port()
        self.worker = Worker("--metrics-listen", f"127.0.0.1:{self.mport}",
                             "--log-level", "warn")
        self.addr = f"127.0.0.1:{self.worker.port}"

    def tearDown(self):
        self.assertEqual(0, self.worker.stop())

    def push(self, *args):
        return subprocess.run([CLI, "push", "--workers", self.addr, *args],
                              capture_output=True, text=True)

    def test_a_scrape_during_and_after_syncs(self):
        m = scrape(self.mport)
        self.assertEqual(0, m[("wtx_updates_published_total", ())])
        self.assertEqual(1, m[("wtx_session_state", (("state", "uninitialized"),))])
        # During a sync big enough to watch: every scrape parses, and one
        # sees an update in flight.
        seen, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                s = scrape(self.mport)
                seen.append(s[("wtx_rl_weight_update_operations_in_flight",
                               (("operation", "update"),))])
                time.sleep(0.005)
        t = threading.Thread(target=watch)
        t.start()
        out = self.push("--backend", "tcp", "--buffer-size", "4M", "--version", "v1",
                        "synthetic:256M")
        stop.set()
        t.join()
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn(1.0, seen)
        self.assertEqual(0, self.push("--version", "v2", "synthetic:256M").returncode)
        m = scrape(self.mport)
        self.assertEqual(2, m[("wtx_updates_published_total", ())])
        self.assertEqual(2, m[("wtx_published_generation", ())])
        total = m[("wtx_published_bytes", ())]
        self.assertGreater(total, 240 << 20)
        self.assertEqual(total, m[("wtx_received_bytes_total", (("backend", "tcp"),))])
        self.assertEqual(total, m[("wtx_received_bytes_total", (("backend", "shm"),))])
        self.assertEqual(1, m[("wtx_session_state", (("state", "ready"),))])
        self.assertGreater(m[("wtx_last_publish_timestamp_seconds", ())], time.time() - 60)
        # vLLM's histogram: its buckets, one observation per call.
        h = "wtx_rl_weight_update_operation_duration_seconds"
        for op in ("init", "start", "prepare", "finish"):
            self.assertEqual(2, m[(h + "_count", (("operation", op),))], op)
        for le in VLLM_BUCKETS:
            self.assertIn((h + "_bucket", (("le", le), ("operation", "update"))), m)
        self.assertEqual(m[(h + "_count", (("operation", "update"),))],
                         m[(h + "_bucket", (("le", "+Inf"), ("operation", "update")))])
        self.assertEqual(0, m[("wtx_rl_weight_update_operations_in_flight",
                               (("operation", "update"),))])

    def test_aborts_and_checksum_failures_are_counted_by_reason(self):
        import grpc
        import xxhash
        from worker_test import Shm, transport_pb2, wt, wt_grpc
        self.assertEqual(0, self.push("--version", "v1", "synthetic:16M").returncode)
        stub = wt_grpc.WeightTransferStub(grpc.insecure_channel(self.addr))
        init = stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
        stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
        stub.AbortWeightUpdate(wt.AbortWeightUpdateRequest(session_id=init.session_id))
        m = scrape(self.mport)
        self.assertEqual(1, m[("wtx_updates_aborted_total", (("reason", "trainer"),))])
        self.assertEqual(0, m[("wtx_checksum_mismatches_total", ())])
        self.assertEqual(0, m[("wtx_updates_failed_total", (("reason", "checksum"),))])
        # A chunk whose bytes do not hash to what the trainer said: the
        # update fails with DATA_LOSS, counted once under its cause.
        # (a tensor of the published model, as the worker knows it)
        meta = stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True)).params[0].meta
        start = stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
        data = bytes(range(256)) * (math.prod(meta.shape) * 2 // 256 + 1)
        data = data[:math.prod(meta.shape) * 2]  # bf16
        shm = Shm(len(data))
        try:
            shm.map[:len(data)] = data
            with self.assertRaises(grpc.RpcError) as cm:
                stub.UpdateWeights(wt.UpdateWeightsRequest(
                    session_id=init.session_id, update_id=start.update_id,
                    update_info=wt.UpdateInfo(
                        params=[meta], chunk_bytes=len(data),
                        xxh3_64=[xxhash.xxh3_64_intdigest(data) ^ 1],
                        shm=transport_pb2.ShmUpdateInfo(region=shm.name, offset=0))))
            self.assertEqual(grpc.StatusCode.DATA_LOSS, cm.exception.code())
        finally:
            shm.close()
        m = scrape(self.mport)
        self.assertEqual(1, m[("wtx_checksum_mismatches_total", ())])
        self.assertEqual(1, m[("wtx_updates_failed_total", (("reason", "checksum"),))])
        self.assertEqual(1, m[("wtx_updates_aborted_total", (("reason", "trainer"),))])
        self.assertEqual(404, self.status("/nothing"))

    def test_an_undone_publish_is_counted_and_serves_the_version_before(self):
        # A trainer undoing the update its Finish published here (another
        # replica failed to): counted once, the version before served
        # again, and a repeated undo counts nothing.
        import grpc
        import xxhash
        from worker_test import Shm, transport_pb2, wt, wt_grpc
        self.assertEqual(0, self.push("--version", "v1", "synthetic:16M").returncode)
        stub = wt_grpc.WeightTransferStub(grpc.insecure_channel(self.addr))
        meta = stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True)).params[0].meta
        init = stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
        start = stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
        data = bytes(math.prod(meta.shape) * 2)  # bf16 zeros
        shm = Shm(len(data))
        try:
            shm.map[:len(data)] = data
            stub.UpdateWeights(wt.UpdateWeightsRequest(
                session_id=init.session_id, update_id=start.update_id,
                update_info=wt.UpdateInfo(
                    params=[meta], chunk_bytes=len(data),
                    xxh3_64=[xxhash.xxh3_64_intdigest(data)],
                    shm=transport_pb2.ShmUpdateInfo(region=shm.name, offset=0))))
        finally:
            shm.close()
        stub.FinishWeightUpdate(wt.FinishWeightUpdateRequest(
            session_id=init.session_id, update_id=start.update_id, weight_version="v2"))
        self.assertEqual(0, scrape(self.mport)[("wtx_updates_reverted_total", ())])
        for reverted in (True, False):
            r = stub.AbortWeightUpdate(wt.AbortWeightUpdateRequest(
                session_id=init.session_id, update_id=start.update_id, reason="undo"))
            self.assertEqual(reverted, r.reverted)
            self.assertEqual("v1", r.weight_version)
        m = scrape(self.mport)
        self.assertEqual(1, m[("wtx_updates_reverted_total", ())])
        self.assertEqual(2, m[("wtx_updates_published_total", ())])
        self.assertEqual("v1", stub.GetWeightInfo(wt.GetWeightInfoRequest()).weight_version)

    def status(self, path):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.mport}{path}", timeout=5)
            return 200
        except urllib.error.HTTPError as e:
            return e.code


if __name__ == "__main__":
    unittest.main(verbosity=2)
