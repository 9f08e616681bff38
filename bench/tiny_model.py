"""Writes a safetensors file of N tiny tensors (F32 [4], MoE-style names),
the control-plane load: every byte of the file is metadata but 16 a tensor;
or, with EACH, of N tensors of F32 [EACH] (20480: 80 KB, as an MoE model's
expert weights are tens of thousands of tensors of their own).
usage: tiny_model.py N PATH [EACH]"""
import json
import struct
import sys

n, path = int(sys.argv[1]), sys.argv[2]
each = int(sys.argv[3]) if len(sys.argv) > 3 else 4
size = 4 * each
header = {f"model.layers.{i // 100}.experts.{i % 100}.w":
          {"dtype": "F32", "shape": [each], "data_offsets": [size * i, size * i + size]}
          for i in range(n)}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.truncate(8 + len(raw) + size * n)  # zeros, without a buffer of them
