"""Writes a safetensors file of N tiny tensors (F32 [4], MoE-style names),
the control-plane load: every byte of the file is metadata but 16 a tensor.
usage: tiny_model.py N PATH"""
import json
import struct
import sys

n, path = int(sys.argv[1]), sys.argv[2]
header = {f"model.layers.{i // 100}.experts.{i % 100}.w":
          {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * i + 16]}
          for i in range(n)}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + bytes(16 * n))
