"""Writes the committed seed corpus of the fuzz targets (fuzz/corpus/).

Run from the repository root with the test venv (scripts/setup.sh):
  .venv/bin/python fuzz/make_seeds.py
Each seed is a well-formed input the fuzzer mutates from; the corpus is
committed so every run starts from the same place.
"""
import os
import struct
import sys
import tempfile

from grpc_tools import protoc
import grpc_tools

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gen = tempfile.mkdtemp()
include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
protos = [os.path.join(root, "proto/wtx/v1", f)
          for f in ("types.proto", "transport.proto", "weight_transfer.proto")]
assert protoc.main(["protoc", f"-I{root}/proto", f"-I{include}", f"--python_out={gen}",
                    *protos]) == 0
sys.path.insert(0, gen)
from wtx.v1 import transport_pb2 as tp, types_pb2 as ty, weight_transfer_pb2 as wt  # noqa

out = os.path.join(root, "fuzz/corpus")


def write(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# requests: the first byte picks the message (fuzz_requests.c's table order)
pack = ty.PackingParams(packed=True, buffer_size_bytes=1 << 20, num_buffers=2)
msgs = [
    (0, "init_shm", wt.InitWeightTransferEngineRequest(init_info=wt.InitInfo(
        shm=tp.ShmInitInfo(), packing=pack, checksum=ty.CHECKSUM_ALGORITHM_XXH3_64,
        timeout_ms=5000))),
    (0, "init_tcp", wt.InitWeightTransferEngineRequest(init_info=wt.InitInfo(
        tcp=tp.TcpInitInfo(upstream_address="127.0.0.1:4000", relay=True,
                           data_token=b"t" * 16)))),
    (1, "start", wt.StartWeightUpdateRequest(session_id="ab" * 16,
                                             target=ty.UPDATE_TARGET_DRAFT)),
    (2, "update", wt.UpdateWeightsRequest(session_id="ab" * 16, update_id=1, update_info=wt.UpdateInfo(
        params=[ty.ParamMeta(name="model.layers.0.w", dtype=ty.DTYPE_BFLOAT16, shape=[4, 8]),
                ty.ParamMeta(name="b", dtype=ty.DTYPE_FLOAT32, shape=[])],
        first_param_offset=0, chunk_bytes=68, xxh3_64=[1, 2],
        shm=tp.ShmUpdateInfo(region="/wtx-x", offset=0)))),
    (2, "update_split", wt.UpdateWeightsRequest(update_info=wt.UpdateInfo(
        params=[ty.ParamMeta(name="w", dtype=ty.DTYPE_UINT8, shape=[100])],
        first_param_offset=40, chunk_bytes=30, tcp=tp.TcpUpdateInfo()))),
    (3, "prepare", wt.PrepareWeightUpdateRequest(session_id="ab" * 16, update_id=1,
                                                 weight_version="step-7")),
    (4, "finish", wt.FinishWeightUpdateRequest(session_id="ab" * 16, update_id=1,
                                               weight_version="v\u00e9")),
    (5, "abort", wt.AbortWeightUpdateRequest(reason="trainer restarted")),
    (6, "version", wt.UpdateWeightVersionRequest(weight_version="step-8")),
    (7, "info", wt.GetWeightInfoRequest(include_params=True, params_offset=2, params_limit=5)),
]
for sel, name, m in msgs:
    write("requests", name, bytes([sel]) + m.SerializeToString())

# tcp_frame: announced (seq, offset, bytes) and the chunk's tensor count,
# then what the peer sent: a frame header and its checksum trailer, a
# trailer alone, or a record
announced = struct.pack("<QQQI", 3, 100, 4096, 2)
frame = b"WTXC" + struct.pack("<IQQQ", 1, 3, 100, 4096)
trailer = b"WTXS" + struct.pack("<IQ", 2, 3) + struct.pack("<QQ", 0x1234, 0x5678)
write("tcp_frame", "frame", announced + frame + trailer)
write("tcp_frame", "trailer", announced + trailer)
hello = b"WTXH" + struct.pack("<II", 1, 16) + bytes(range(1, 17)) + bytes(48)
write("tcp_frame", "hello", hello)
for magic in (b"WTXW", b"WTXP", b"WTXD", b"WTXR", b"WTXG"):
    write("tcp_frame", "record-" + magic.decode()[-1], magic + struct.pack("<IQ", 7, 9))

# session: calls to a real worker (fuzz_session.c): a byte (the method's
# index in the service, 0x10: this run's session, 0x20: its update, 0x40:
# the shm region that exists), two bytes of length, the request
S, U, R = 0x10, 0x20, 0x40


def call(method, flags, m):
    b = m.SerializeToString()
    return bytes([method | flags]) + struct.pack("<H", len(b)) + b


def region(n):  # the region's first n bytes, as fuzz_session.c fills it
    return bytes((i * 131 + 7) & 0xFF for i in range(n))


def chunk(sums):
    params = [ty.ParamMeta(name="a", dtype=ty.DTYPE_FLOAT32, shape=[32]),
              ty.ParamMeta(name="b", dtype=ty.DTYPE_UINT8, shape=[128])]
    ui = wt.UpdateInfo(params=params, chunk_bytes=256, shm=tp.ShmUpdateInfo(region="x"))
    if sums:
        import xxhash
        data = region(256)
        ui.xxh3_64.extend([xxhash.xxh3_64_intdigest(data[:128]),
                           xxhash.xxh3_64_intdigest(data[128:])])
    return wt.UpdateWeightsRequest(update_info=ui)


for name, sums in (("publish-undo", False), ("publish-checked", True)):
    init = wt.InitWeightTransferEngineRequest(init_info=wt.InitInfo(
        shm=tp.ShmInitInfo(), checksum=ty.CHECKSUM_ALGORITHM_XXH3_64 if sums else 0))
    seq = [call(0, 0, init), call(1, S, wt.StartWeightUpdateRequest()),
           call(2, S | U | R, chunk(sums)),
           call(3, S | U, wt.PrepareWeightUpdateRequest(weight_version="v1")),
           call(4, S | U, wt.FinishWeightUpdateRequest()),
           call(1, S, wt.StartWeightUpdateRequest()), call(2, S | U | R, chunk(sums)),
           call(4, S | U, wt.FinishWeightUpdateRequest(weight_version="v2")),
           call(5, S | U, wt.AbortWeightUpdateRequest(reason="undo")),
           call(7, 0, wt.GetWeightInfoRequest(include_params=True))]
    write("session", name, b"".join(seq))

# safetensors: a file with metadata and two tensors
header = (b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],'
          b'"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}}')
write("safetensors", "two", struct.pack("<Q", len(header)) + header + bytes(12))
