"""Faults with real processes: a trainer killed during init, mid-chunk,
before finish and after a delta's patch was applied in staging; a delta
push killed mid-transfer; a worker frozen with SIGSTOP; 1000 init/abort sessions with
flat memory and descriptors; 64 inspectors during a 1 GB sync. After each,
the published weights are bit-exact (every tensor's XXH3 as published
before) and the next sync goes through.

Run by tests/python/run.sh fault_test.py (//tests/python:fault_test).
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import unittest

import grpc

from worker_test import (CLI, GEN, Worker, metrics_address, transport_pb2, types_pb2,
                         wait_running, wt, wt_grpc)


def published(stub):
    """The published version and every tensor's XXH3, as the worker lists it."""
    info = stub.GetWeightInfo(wt.GetWeightInfoRequest(include_params=True), timeout=10)
    return info.weight_version, {p.meta.name: p.xxh3_64 for p in info.params}


def push(addr, version, size="16M", *extra):
    return subprocess.run([CLI, "push", "--workers", addr, "--backend", "tcp",
                           "--buffer-size", "1M", "--version", version, "--timeout-ms",
                           "5000", *extra, f"synthetic:{size}"],
                          capture_output=True, text=True, timeout=120)


def wait_for(pred, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


# A trainer as its own process, killed by the test at a chosen step: it
# drives one session over shm and stops (SIGKILLs itself) where told.
TRAINER = textwrap.dedent("""
    import os, signal, struct, sys
    import xxhash
    sys.path.insert(0, %(gen)r)
    import grpc
    from wtx.v1 import transport_pb2, types_pb2, weight_transfer_pb2 as wt
    from wtx.v1 import weight_transfer_pb2_grpc as wt_grpc
    addr, stop_at = sys.argv[1], sys.argv[2]
    stub = wt_grpc.WeightTransferStub(grpc.insecure_channel(addr))
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    init = stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
        init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
    if stop_at == "init": die()
    if stop_at == "patch-before-finish":  # a delta of v1: a patch, applied, never finished
        start = stub.StartWeightUpdate(wt.StartWeightUpdateRequest(
            session_id=init.session_id, base_version="v1"))
        assert start.patches
        name = "/wtx-fault-%%d" %% os.getpid()
        fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_RDWR, 0o600)
        wire = struct.pack("<3i", 0, 7, 100) + os.urandom(6)  # 3 indices, 3 bf16 values
        os.ftruncate(fd, len(wire))
        os.pwrite(fd, wire, 0)
        stub.UpdateWeights(wt.UpdateWeightsRequest(
            session_id=init.session_id, update_id=start.update_id,
            update_info=wt.UpdateInfo(
                params=[types_pb2.ParamMeta(name="model.embed_tokens.weight",
                                            dtype=types_pb2.DTYPE_BFLOAT16, shape=[1024, 256],
                                            patch=types_pb2.Patch(
                                                index_dtype=types_pb2.DTYPE_INT32, count=3))],
                chunk_bytes=len(wire), xxh3_64=[xxhash.xxh3_64_intdigest(wire)],
                shm=transport_pb2.ShmUpdateInfo(region=name))))
        die()
    start = stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
    name = "/wtx-fault-%%d" %% os.getpid()
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_RDWR, 0o600)
    # v1's first tensor (the synthetic model's embedding), new bytes.
    os.ftruncate(fd, 1 << 19)
    data = os.urandom(1 << 19)
    os.pwrite(fd, data, 0)
    # Half the tensor, then (unless stopped mid-chunk) the other half.
    for half in (0, 1):
        if stop_at == "mid-chunk" and half == 1: die()
        stub.UpdateWeights(wt.UpdateWeightsRequest(
            session_id=init.session_id, update_id=start.update_id,
            update_info=wt.UpdateInfo(
                params=[types_pb2.ParamMeta(name="model.embed_tokens.weight",
                                            dtype=types_pb2.DTYPE_BFLOAT16, shape=[1024, 256])],
                first_param_offset=half << 18, chunk_bytes=1 << 18,
                xxh3_64=[xxhash.xxh3_64_intdigest(data)] if half else [],
                shm=transport_pb2.ShmUpdateInfo(region=name, offset=half << 18))))
    if stop_at == "before-finish": die()
""")


class FaultTest(unittest.TestCase):
    def setUp(self):
        self.w = Worker("--watchdog-ms", "1000", "--log-level", "warn")
        self.addr = f"127.0.0.1:{self.w.port}"
        self.stub = wt_grpc.WeightTransferStub(self.w.channel)
        out = push(self.addr, "v1")
        self.assertEqual(0, out.returncode, out.stderr)
        self.v1 = published(self.stub)
        self.assertEqual("v1", self.v1[0])

    def tearDown(self):
        self.assertEqual(0, self.w.stop(), self.w.log())

    def assert_v1_then_next_sync(self):
        self.assertTrue(wait_for(lambda: self.stub.GetWeightInfo(
            wt.GetWeightInfoRequest()).state != wt.SESSION_STATE_UPDATING), "never aborted")
        self.assertEqual(self.v1, published(self.stub))  # bit-exact
        out = push(self.addr, "v2")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual("v2", published(self.stub)[0])

    def kill_trainer_at(self, step):
        script = TRAINER % {"gen": GEN}
        p = subprocess.run([sys.executable, "-c", script, self.addr, step],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(-signal.SIGKILL, p.returncode, p.stderr)

    def test_a_trainer_killed_during_init(self):
        self.kill_trainer_at("init")
        self.assert_v1_then_next_sync()

    def test_a_trainer_killed_mid_chunk(self):
        self.kill_trainer_at("mid-chunk")
        self.assert_v1_then_next_sync()

    def test_a_trainer_killed_before_finish(self):
        self.kill_trainer_at("before-finish")
        self.assert_v1_then_next_sync()

    def test_a_trainer_killed_after_a_patch_was_applied_in_staging(self):
        self.kill_trainer_at("patch-before-finish")
        self.assert_v1_then_next_sync()

    # A push killed mid-transfer, of its own bigger model (slow enough to be
    # caught mid-transfer): one buffer of 1 MiB, so every chunk is one round
    # trip. SLOW: its flags for every push of it.
    SLOW = ("--num-buffers", "1", "--timeout-ms", "20000")

    def kill_push_mid_transfer(self, first, *extra):
        """A worker that published version `first`, then a push with extra
        flags killed while its update runs: the worker serves `first`
        bit-exact. Returns the worker and its stub, for the next pushes."""
        w = Worker("--watchdog-ms", "1000", "--log-level", "warn")
        addr, stub = f"127.0.0.1:{w.port}", wt_grpc.WeightTransferStub(w.channel)
        out = push(addr, first, "256M", *self.SLOW)
        self.assertEqual(0, out.returncode, out.stderr)
        before = published(stub)
        p = subprocess.Popen([CLI, "push", "--workers", addr, "--backend", "tcp",
                              "--buffer-size", "1M", *self.SLOW, *extra, "--version", "never",
                              "synthetic:256M"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        updating = wait_for(lambda: p.poll() is not None or stub.GetWeightInfo(
            wt.GetWeightInfoRequest()).state == wt.SESSION_STATE_UPDATING, 60)
        self.assertTrue(updating and p.poll() is None, "the push ended before it was killed: "
                        "%s" % (p.stderr.read() if p.poll() is not None else "timeout"))
        p.kill()
        p.wait()
        p.stderr.close()
        self.assertTrue(wait_for(lambda: stub.GetWeightInfo(
            wt.GetWeightInfoRequest()).state != wt.SESSION_STATE_UPDATING), "never aborted")
        self.assertEqual(before, published(stub))  # bit-exact
        return w, addr, stub

    def test_a_wtx_push_killed_mid_transfer(self):
        w, addr, _ = self.kill_push_mid_transfer("big-1")
        out = push(addr, "big-2", "256M", *self.SLOW)
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual(0, w.stop())

    def test_a_delta_push_killed_mid_transfer_leaves_v1_and_the_next_delta_lands(self):
        # A delta where every tensor changed (another seed): all 256 MB move.
        w, addr, stub = self.kill_push_mid_transfer("d-1", "--patches", "--seed", "1")
        out = push(addr, "d-2", "256M", *self.SLOW, "--delta", "--seed", "1")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual("d-2", published(stub)[0])
        # A new trainer learns what the worker serves: nothing left to send.
        out = push(addr, "d-3", "256M", *self.SLOW, "--delta", "--seed", "1")
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertIn("pushed 0 params, 0 bytes", out.stdout)
        self.assertEqual(0, w.stop())


class FrozenWorkerTest(unittest.TestCase):
    def test_a_frozen_worker_fails_the_sync_in_time_and_every_replica_keeps_v1(self):
        a, b = Worker("--log-level", "warn"), Worker("--log-level", "warn")
        addrs = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
        out = push(addrs, "v1")
        self.assertEqual(0, out.returncode, out.stderr)
        sa, sb = wt_grpc.WeightTransferStub(a.channel), wt_grpc.WeightTransferStub(b.channel)
        v1a = published(sa)
        b.proc.send_signal(signal.SIGSTOP)
        t0 = time.time()
        out = push(addrs, "v2")
        self.assertNotEqual(0, out.returncode)
        self.assertIn(f"worker 1 (127.0.0.1:{b.port})", out.stderr)
        self.assertLess(time.time() - t0, 30)  # bounded by --timeout-ms, never a hang
        self.assertEqual(v1a, published(sa))  # the live replica did not move on alone
        b.proc.send_signal(signal.SIGCONT)
        self.assertEqual(v1a[1], published(sb)[1])
        out = push(addrs, "v3")  # both take the next sync
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual("v3", published(sa)[0])
        self.assertEqual("v3", published(sb)[0])
        self.assertEqual(0, a.stop())
        self.assertEqual(0, b.stop())


class RendezvousTest(unittest.TestCase):
    """NCCL's rendezvous waits for ever for a rank that never comes (the
    CUDA/NCCL TEST DOUBLE waits the same way): the worker joins without
    blocking, so a timeout, an abort or SIGTERM ends the wait."""

    def start(self, *extra):
        env = dict(os.environ, WTX_CUDART_LIB=os.environ["WTX_FAKE_CUDA"],
                   WTX_NCCL_LIB=os.environ["WTX_FAKE_CUDA"], WTX_CUDA_DEVICE="1")
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            return Worker("--grace-ms", "300", "--log-level", "info", *extra)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def init_call(self, stub, tag, timeout_ms=0):
        uid = (b"/wtxfakenccl-%s-%d" % (tag, os.getpid())).ljust(128, b"\0")
        return stub.InitWeightTransferEngine.future(wt.InitWeightTransferEngineRequest(
            init_info=wt.InitInfo(timeout_ms=timeout_ms, nccl=transport_pb2.NcclInitInfo(
                unique_id=uid, world_size=2, rank_offset=1))))

    def test_sigterm_during_a_rendezvous_cancels_it_and_exits_cleanly(self):
        metrics = metrics_address()
        w = self.start("--metrics-listen", metrics)
        stub = wt_grpc.WeightTransferStub(w.channel)
        call = self.init_call(stub, b"sigterm")
        # The init is running: the worker waits for rank 0, which never comes.
        self.assertTrue(wait_running(metrics, "init"))
        info = stub.GetWeightInfo(wt.GetWeightInfoRequest(), timeout=2)  # not blocked
        self.assertEqual(wt.SESSION_STATE_UNINITIALIZED, info.state)
        t0 = time.time()
        w.proc.send_signal(signal.SIGTERM)
        self.assertEqual(0, w.proc.wait(timeout=20))
        self.assertLess(time.time() - t0, 0.3 + 1.0)
        self.assertNotIn("event=forced_exit", w.log())  # the wait ended, nothing was forced
        with self.assertRaises(grpc.RpcError):
            call.result(timeout=5)
        w.channel.close()

    def test_a_rank_that_never_comes_is_a_timeout_not_a_hang(self):
        w = self.start()
        stub = wt_grpc.WeightTransferStub(w.channel)
        t0 = time.time()
        call = self.init_call(stub, b"timeout", timeout_ms=700)
        with self.assertRaises(grpc.RpcError) as e:
            call.result(timeout=20)
        self.assertLess(time.time() - t0, 5)
        self.assertEqual(grpc.StatusCode.DEADLINE_EXCEEDED, e.exception.code())
        self.assertIn("not every rank joined within 700 ms", e.exception.details())
        info = stub.GetWeightInfo(wt.GetWeightInfoRequest(), timeout=2)
        self.assertEqual(wt.SESSION_STATE_UNINITIALIZED, info.state)
        self.assertEqual(0, w.stop())


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class SoakTest(unittest.TestCase):
    def test_a_thousand_init_abort_sessions_keep_memory_and_descriptors_flat(self):
        w = Worker("--log-level", "warn")
        stub = wt_grpc.WeightTransferStub(w.channel)

        def session():
            init = stub.InitWeightTransferEngine(wt.InitWeightTransferEngineRequest(
                init_info=wt.InitInfo(shm=transport_pb2.ShmInitInfo())))
            stub.StartWeightUpdate(wt.StartWeightUpdateRequest(session_id=init.session_id))
            stub.AbortWeightUpdate(wt.AbortWeightUpdateRequest(session_id=init.session_id))
        for _ in range(100):  # warm up allocator and gRPC
            session()
        rss0, fds0 = rss_kb(w.proc.pid), len(os.listdir(f"/proc/{w.proc.pid}/fd"))
        for _ in range(1000):
            session()
        rss1, fds1 = rss_kb(w.proc.pid), len(os.listdir(f"/proc/{w.proc.pid}/fd"))
        self.assertLessEqual(fds1, fds0 + 2, (fds0, fds1))
        if "ASAN_OPTIONS" not in os.environ:
            self.assertLess(rss1 - rss0, 8 * 1024, (rss0, rss1))  # < 8 MiB for 1000 sessions
        # (Under ASan the RSS is its quarantine of freed memory; LeakSanitizer
        # checks the worker at exit instead, and a leak makes stop() fail.)
        self.assertEqual(0, w.stop())

    def test_sixty_four_inspectors_during_a_one_gigabyte_sync(self):
        w = Worker("--log-level", "warn")
        addr = f"127.0.0.1:{w.port}"
        done, failures, calls = threading.Event(), [], [0]

        def inspect():
            stub = wt_grpc.WeightTransferStub(grpc.insecure_channel(addr))
            while not done.is_set():
                try:
                    stub.GetWeightInfo(wt.GetWeightInfoRequest(), timeout=10)
                    stub.GetWorldSize(wt.GetWorldSizeRequest(), timeout=10)
                    calls[0] += 1
                except grpc.RpcError as e:
                    failures.append(e.code())
        threads = [threading.Thread(target=inspect) for _ in range(64)]
        for t in threads:
            t.start()
        out = push(addr, "big", "1G", "--timeout-ms", "120000")
        done.set()
        for t in threads:
            t.join()
        self.assertEqual(0, out.returncode, out.stderr)
        self.assertEqual([], failures)
        self.assertGreater(calls[0], 64)
        self.assertEqual(0, w.stop())


if __name__ == "__main__":
    unittest.main(verbosity=2)
